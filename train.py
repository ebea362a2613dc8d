"""
Train a GPT and measure its gradient noise scale from exact per-example gradient norms: nanoGPT's
training script and flags, plus per-example-norm layers (--linearclass, --embeddingclass,
--lnclass), GNS estimators logged to out_dir/log.csv, training counted in tokens (nanoGPT's
iteration lengths are converted), and an optional batch-size schedule editable mid-run.

$ python train.py config/train_shakespeare_char_cpu.py --lnclass=shim
$ torchrun --standalone --nproc_per_node=4 train.py config/train_cgpt_111M_owt.py
"""
import os
import sys
import time
from contextlib import nullcontext
os.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')  # before torch loads OpenMP: threads spinning while they wait stall a busy machine (README)
from nanogns.stopping import interrupt_in_one_line
interrupt_in_one_line()  # before the slow imports: Ctrl-C while starting is one line
if hasattr(sys.stdout, 'reconfigure'):  # each status line reaches a redirected file as it is printed
    sys.stdout.reconfigure(line_buffering=True)
import numpy as np
import torch

import nanogns.estimators.exact as gnstracking
from checkpoint import (CheckpointError, data_order, eval_generator, init_model, load_optimizer_state, model_args_for,
                        resumed_counts, run_identity, save_training_state, step_seed, training_run_state)
from configurator import check_resources, configure_train, dataset_vocab_size, die
from nanogns.layers import choose_linear_norm_methods, layer_kinds, linear_norm_methods, set_per_example_mode
from nanogns.layers.config import classes_for_flags, set_contextual_config
from model import clip_unscaled, fully_shard_gpt, grad_scaler, gradient_norm, step_unless_nonfinite
from nanogns.pending import PendingSteps
from nanogns.schedules import lr_at, step_sizes_for_run
from nanogns.stopping import StopSignals, checkpoint_after, diverged_message, leave, log_step_or_stop, stop_early, stopped_message
from nanogns.runlog import OutDirInUse, lock_out_dir, log_for_run

# -----------------------------------------------------------------------------
# default config values: a GPT-2 (124M) on OpenWebText, as in nanoGPT
# I/O
out_dir = 'out'  # where ckpt.pt, log.csv, config.json go (one run's alone)
eval_interval = 2000  # evaluate (and checkpoint) every this many iterations
log_interval = 1  # print a status line (and read the device) every this many iterations
eval_iters = 200  # batches per split in each evaluation
eval_only = False  # if True, exit right after the first eval
always_save_checkpoint = True  # if True, save a checkpoint after each eval, not only on improvement
init_from = 'scratch'  # 'scratch' or 'resume' or 'gpt2*'
# wandb logging
wandb_log = False  # also log to Weights & Biases
wandb_project = 'owt'  # its project
wandb_run_name = 'gpt2'  # its run name
# data
dataset = 'openwebtext'  # a folder under data/ (or a path to one) holding train.bin, val.bin
gradient_accumulation_steps = 5 * 8  # global: divided across DDP ranks
batch_size = 12  # micro-batch size per process
block_size = 1024  # tokens per example (sequence length)
# model
n_layer = 12  # transformer blocks
n_head = 12  # attention heads per block
n_embd = 768  # model width
dropout = 0.0  # for pretraining 0 is good, for finetuning try 0.1+
bias = False  # biases in the Linears and the normalisations
# Llama-style options (model.GPTConfig); the defaults are GPT-2's
norm = 'layernorm'  # or 'rmsnorm'
mlp = 'gelu'  # or 'swiglu'
pos_emb = 'learned'  # or 'rope'
tie_embeddings = True  # lm_head shares wte's weight
# mixture of experts (model.MoE): 0 is a dense MLP
n_expert = 0  # experts per MLP, each a GELU MLP of the dense one's width
n_expert_active = 2  # experts each token goes to (top-k routing)
moe_aux_loss_coef = 0.0  # weight of Switch's load-balancing loss (0: none)
cos_attn = []  # block indices with cosine attention
spectral_c_attn = []  # block indices with spectral-normalised Q/K/V
fp32_attention_layers = []  # block indices whose attention runs in float32
device_name = 'A100'  # peak-FLOPs entry for MFU (see model.PEAK_FLOPS)
# per-example-norm layers (nanogns.layers.config.FLAG_CLASSES): nn (torch's, not measured), gns (norms
# in the layer's own backward), shim (torch's backward, norms beside it), fused (the normalisation kernel)
linearclass = 'nn'  # nn, gns or shim: the Linears' class
embeddingclass = 'nn'  # nn, gns or shim: the token/position Embeddings' class
lnclass = 'nn'  # nn, shim or fused: the LayerNorms'/RMSNorms' class
per_example_mode = 'auto'  # Linears' weight norms: auto (routes table, else shapes; chosen once), shapes (per call), ghost, materialise
# earlier estimators, logged beside the exact one for comparison: hooks on nn.Linear layers
# (nanogns/estimators/hooks.py), the micro-batch estimator (nanogns/estimators/microbatch.py)
gns_hooks = 'none'  # none, sogns or exact
microbatch_gns = False  # also the micro-batch estimator
gns_adam = False  # also the Adam-preconditioned GNS of the normalisation layers (nanogns/estimators/adam.py; --lnclass=shim)
# AdamW optimizer; lengths in tokens or, as in nanoGPT, iterations (unset: nanoGPT's)
learning_rate = 6e-4  # peak learning rate
max_tokens = None  # train until this many tokens (or max_iters; unset: nanoGPT's 600000 iterations)
max_iters = None  # nanoGPT's: iterations (they also stop a run whose batch-size schedule shortens them)
weight_decay = 1e-1  # AdamW's, on matrices only
beta1 = 0.9  # AdamW's
beta2 = 0.95  # AdamW's
grad_clip = 1.0  # clip gradients at this norm, or disable if == 0.0
decay_lr = True  # warm up and decay the learning rate (False: constant)
warmup_tokens = None  # linear warmup from 0 to learning_rate
warmup_iters = None  # nanoGPT's: the warmup in iterations
lr_decay_tokens = None  # then linear decay to min_lr by here
lr_decay_iters = None  # nanoGPT's: the decay's end in iterations
min_lr = 6e-5  # the learning rate at the end of the decay
lr_decay_shape = 'linear'  # or 'cosine', nanoGPT's
max_nonfinite_steps = 5  # stop after this many steps in a row with a non-finite gradient (float32/bfloat16)
# batch-size schedule: accumulation steps piecewise linear in tokens, out_dir/grad_accum_schedule.txt
bs_schedule = False  # accumulation steps from out_dir/grad_accum_schedule.txt (editable mid-run)
bs_schedule_points = []  # [(tokens, global accumulation steps), ...]; [] = 2 at 0 tokens (as the reference) to gradient_accumulation_steps at max_tokens
# or the batch from the measured GNS (schedules.GNSBatchController): bs_gns_fraction x the live GNS
# of bs_gns_group, in global accumulation steps from bs_min_accum up to gradient_accumulation_steps
bs_controller = 'none'  # or 'gns'
bs_gns_fraction = 1.0  # the batch follows this fraction of the live GNS
bs_gns_group = None  # 'total', 'LayerNorm' or 'adam' (--gns_adam); None: the group measured (LayerNorm when LayerNorms alone are)
bs_min_accum = 1  # the floor, and the start
bs_warmup_steps = 50  # steps the GNS's EMA averages before the batch follows it
bs_update_tokens = None  # at most one change per this many tokens; None: max_tokens / 100
bs_allow_decrease = False  # let the batch shrink when the GNS falls
# system
backend = 'nccl'  # 'nccl' for GPUs, 'gloo' for CPU
fsdp = False  # under torchrun, shard weights, gradients and optimizer state (FSDP2) instead of DDP's replicas
device = 'cuda'  # 'cpu', 'cuda', 'cuda:1', 'mps'
# float32, bfloat16 or float16 (autocast); without CUDA float32 (float16 on a CPU is emulated, slow)
dtype = ('bfloat16' if torch.cuda.is_bf16_supported() else 'float16') if torch.cuda.is_available() else 'float32'  # the autocast dtype
compile = True  # torch.compile the model (PyTorch 2)
seed = 1337  # the random seed (each DDP rank adds its rank)
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items()
               if not k.startswith('_') and isinstance(v, (int, float, bool, str, list, type(None)))]
config = {k: globals()[k] for k in config_keys}
# -----------------------------------------------------------------------------
places = configure_train(sys.argv[1:], config, __doc__)  # every value checked before anything runs: bad input is one line and exit 2
globals().update(config)
# the device, the prepared data (a block from each split), and room for the model and a micro-batch: or exit 2
device_type, data_dir = check_resources(config, root=os.path.dirname(os.path.abspath(__file__)))

# DDP: a torchrun launch sets RANK
ddp = int(os.environ.get('RANK', -1)) != -1
if ddp:
    from torch.distributed import init_process_group, destroy_process_group
    from torch.nn.parallel import DistributedDataParallel as DDP
    init_process_group(backend=backend)
    ddp_rank, ddp_local_rank, ddp_world_size = (int(os.environ[k]) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE'))
    if device_type == 'cuda':
        device = f'cuda:{ddp_local_rank}'
        torch.cuda.set_device(device)
    master_process = ddp_rank == 0  # this process logs and checkpoints
    seed_offset = ddp_rank  # each process gets a different seed
    gradient_accumulation_steps //= ddp_world_size  # global: check_train_config saw that it divides
else:
    master_process, seed_offset, ddp_world_size, ddp_rank = True, 0, 1, 0
tokens_per_micro_step = ddp_world_size * batch_size * block_size
print(f"tokens per iteration will be: {gradient_accumulation_steps * tokens_per_micro_step:,}")
if master_process and not eval_only:  # out_dir is this run's alone (eval_only writes nothing there)
    try:
        out_dir_lock = lock_out_dir(out_dir, set_aside=init_from != 'resume')  # an earlier run is kept
    except OutDirInUse as e:
        die(f"--out_dir={e}")
torch.manual_seed(seed + seed_offset)
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
ctx = nullcontext() if dtype == 'float32' else torch.autocast(device_type=device_type, dtype=ptdtype)


# poor man's data loader: memory-map the token file anew each batch (avoids a memmap leak)
def get_batch(split, rng=None):
    global data_order_state
    if rng is None:  # the train order: a checkpoint keeps the state before the batch fetched ahead, which a resume redraws
        rng, data_order_state = batch_rng, batch_rng.get_state()
    data = np.memmap(os.path.join(data_dir, f'{split}.bin'), dtype=np.uint16, mode='r')
    if len(data) <= block_size:
        die(f"{split}.bin holds {len(data)} tokens, too few for block_size={block_size}")
    # every rank draws the global micro-batch and keeps its slice: the examples of a step do not depend
    # on the processes sharing them (2 ranks see the batches of 1 process with twice the batch_size)
    ix = torch.randint(len(data) - block_size, (ddp_world_size * batch_size,), generator=rng)
    ix = ix[ddp_rank * batch_size:(ddp_rank + 1) * batch_size]
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    if device_type == 'cuda':
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


meta_vocab_size = dataset_vocab_size(data_dir)  # from meta.pkl (character-level datasets), else None
model_args = model_args_for(config, meta_vocab_size)  # the flags named after GPTConfig's fields, and vocab_size
# from scratch, from out_dir/ckpt.pt (nanoGPT's and the reference's too) or OpenAI's GPT-2, in the layer classes the flags choose
with set_contextual_config(**classes_for_flags(linearclass=linearclass, embeddingclass=embeddingclass, lnclass=lnclass)):
    try:
        model, checkpoint = init_model(init_from, model_args, config, out_dir, device, meta_vocab_size, places)
    except (CheckpointError, TypeError, ValueError) as e:
        die(f"--init_from={init_from}: {e}")
# config.json names the model built, and the run: a resume checks that ckpt.pt and config.json are the same run's
config.update({k: v for k, v in model_args.items() if k in config or k == 'vocab_size'}, run_id=run_identity(checkpoint))
set_per_example_mode(model, per_example_mode)
iter_num, best_val_loss, nonfinite_steps = resumed_counts(checkpoint)  # nonfinite_steps: steps in a row skipped, not finite
model.to(device)
if fsdp:  # FSDP: shard in place before the optimizer is built on the (sharded) parameters
    fully_shard_gpt(model, device_type, ddp_world_size, bf16_params=(device_type == 'cuda' and dtype == 'bfloat16'))
batch_rng = data_order(seed, checkpoint)  # the train batches' order, where a resumed run's checkpoint left it
scaler = grad_scaler(device_type, enabled=(dtype == 'float16'), fsdp=fsdp)  # FSDP: an overflow on one rank skips the step on all
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type, fused=not (fsdp and scaler.is_enabled()))
if checkpoint is not None:
    try:
        load_optimizer_state(checkpoint, optimizer, scaler, fsdp_model=model if fsdp else None)
    except CheckpointError as e:
        die(f"--init_from=resume: {out_dir}/ckpt.pt: {e}")
raw_model = model  # the module whose state is checkpointed, whatever wraps it below
if compile:
    print(f"compiling the model (in the first step: {'minutes on a CPU' if device_type == 'cpu' else 'about a minute'})")
    model = torch.compile(model)
eval_model = model  # evaluation runs on the master alone, so it must not go through DDP (FSDP: on every rank)
if ddp and not fsdp:
    # broadcast_buffers=False: every rank keeps its own per-example-norm buffers (rank 0's must
    # not overwrite the others' each forward), and tokens_processed advances alike everywhere
    model = DDP(model, device_ids=[ddp_local_rank] if device_type == 'cuda' else None, broadcast_buffers=False)

# GNS estimators: the per-example one if a layer measures, the DDP one, the hooks' and micro-batch one if asked
estimators = gnstracking.estimators_for(raw_model, ddp_model=model if ddp and not fsdp else None, world_size=ddp_world_size,
                                        hooks=gns_hooks, microbatch=microbatch_gns, checkpoint=checkpoint, fsdp=fsdp,
                                        adam_optimizer=optimizer if gns_adam else None)
if compile:  # the compiled graph reads no routes table: the "auto" Linears not restored above choose now, at training's shapes
    choose_linear_norm_methods(raw_model, batch_size, block_size, device, ptdtype)

try:  # what sizes each step when it is not fixed: the editable schedule file, or the controller on the GNS
    schedule = step_sizes_for_run(config, estimators, ddp_world_size, master_process, device if ddp else None, checkpoint)
except ValueError as e:
    die(str(e))

try:  # the master's out_dir/log.csv (a row per iteration, crash-safe), config.json, layer_kinds.json, wandb
    logger = log_for_run(config, iter_num if init_from == 'resume' else None, layer_kinds(raw_model)) if master_process else None
except (ValueError, OSError) as e:
    die(f"--init_from=resume: {e}" if init_from == 'resume' else str(e))
params = [p for p in raw_model.parameters() if p.requires_grad]
last_checkpoint = checkpoint_after(iter_num) if init_from == 'resume' else "nothing (none was written)"
tokens_processed = int(raw_model.tokens_processed)  # a host copy of the model's buffer: reading that would sync
local_iter_num = 0  # iterations of this process (MFU skips the first, slow ones)
signals = StopSignals(announce=master_process, checkpoint_held=lambda: last_checkpoint, distributed=ddp)


@torch.no_grad()
def estimate_loss():
    """Mean loss over eval_iters batches of each split."""
    means = torch.zeros(2, device=device)  # on the device: one read per evaluation, not one per batch
    eval_model.eval()
    for s, split in enumerate(['train', 'val']):
        losses = torch.zeros(eval_iters, device=device)
        for k in range(eval_iters):
            X, Y = get_batch(split, eval_generator(seed, iter_num, split))
            with ctx:
                logits, loss = eval_model(X, Y)
            losses[k] = loss
        means[s] = losses.mean()
    if fsdp:  # FSDP: every rank evaluated its slice of the same batches; their mean is the batches' loss
        torch.distributed.all_reduce(means)
        means /= ddp_world_size
    eval_model.train()
    return dict(zip(('train', 'val'), means.tolist()))


def flush_steps():
    """Read the pending steps' device values into their rows (the master logs each); a diverged run stops after the last."""
    global nonfinite_steps
    diverged = None
    for row in pending.read():
        step, nonfinite_steps = row['iter_num'], int(row.pop('nonfinite_steps'))
        if master_process:  # with the first row of this process, the method each measured Linear chose
            log_step_or_stop(logger, ddp, linear_norm_methods(raw_model) if step == first_iter else None, row)
        if nonfinite_steps >= max_nonfinite_steps and diverged is None and not (last_step and row is step_row):
            diverged = step
    if diverged is not None:
        stop_early(diverged_message(step, diverged, nonfinite_steps, max_nonfinite_steps, last_checkpoint), 1, logger, ddp)


def save_checkpoint():
    """ckpt.pt, never from non-finite weights; a failed write (a full disk) stops the run."""
    global last_checkpoint
    flush_steps()  # the estimators' states and the non-finite count up to this step
    run_state = training_run_state(scaler, model_args, config, iter_num, best_val_loss, nonfinite_steps, data_order_state,
                                   estimators, schedule if bs_controller == 'gns' else None, logger and logger.last_row())
    try:  # FSDP: every rank takes part in gathering the full state onto rank 0, which alone writes it
        if save_training_state(os.path.join(out_dir, 'ckpt.pt'), raw_model, optimizer, run_state, fsdp, master_process):
            last_checkpoint = checkpoint_after(iter_num)
        elif master_process:
            print(f"not saving a checkpoint: the weights are not finite; ckpt.pt keeps {last_checkpoint}")
    except CheckpointError as e:
        stop_early(f"{e}; ckpt.pt keeps {last_checkpoint}", 1, logger, ddp)


def evaluate_and_checkpoint(row):
    """The losses into `row`, log.csv's row of the step the evaluation comes before (after, for the last)."""
    global best_val_loss
    losses = estimate_loss()
    if master_process:  # FSDP: every rank evaluates and checkpoints, the master logs
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        # eval_tokens: what the evaluated model has seen (the row's tokens_processed counts its step too)
        row.update({'train/loss': losses['train'], 'val/loss': losses['val'], 'eval_tokens': tokens_processed})
    if losses['val'] < best_val_loss or always_save_checkpoint:
        best_val_loss = min(best_val_loss, losses['val'])
        if local_iter_num > 0:  # nothing new to save before this process has taken a step
            save_checkpoint()


def finished(tokens, iters):
    return tokens >= max_tokens or (max_iters is not None and iters >= max_iters)


X, Y = get_batch('train')
t0, running_mfu = time.time(), -1.0
pending, first_iter, nonfinite_on_device = PendingSteps(), iter_num, nonfinite_steps  # the unlogged steps; a device count
while eval_only or not finished(tokens_processed, iter_num):
    torch.manual_seed(step_seed(seed, seed_offset, iter_num))  # dropout: a resumed step draws what it drew
    if schedule is not None:
        gradient_accumulation_steps = schedule.steps_at(tokens_processed, ddp_world_size)
    tokens_this_step = gradient_accumulation_steps * tokens_per_micro_step
    lr = lr_at(tokens_processed + tokens_this_step, learning_rate, min_lr, warmup_tokens, lr_decay_tokens, decay_lr, lr_decay_shape)
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr
    last_step = finished(tokens_processed + tokens_this_step, iter_num + 1)

    # the last step's evaluation comes after it (below): readers of log.csv find GNS on every row
    step_row = {}
    if (master_process or fsdp) and (eval_only or (iter_num % eval_interval == 0 and not last_step)):
        evaluate_and_checkpoint(step_row)
    if eval_only:
        if master_process:
            log_step_or_stop(logger, ddp, row=step_row)  # to wandb only
        break

    # forward/backward with gradient accumulation; the per-example-norm layers add into their buffers
    for micro_step in range(gradient_accumulation_steps):
        if ddp and not fsdp:  # (FSDP reduce-scatters every micro-step: no unsharded gradient is kept)
            # sync gradients only on the last micro-step (nanoGPT's no_sync shortcut)
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps  # the loss of the whole step is a mean
        X, Y = get_batch('train')  # prefetch the next batch while the GPU works
        scaler.scale(loss).backward()

    # the norm (logged whether or not it clips, the same on every rank); a step from non-finite gradients (they would
    # ruin the weights) is skipped by the optimizer and the GNS estimators alike, decided on the device
    grad_norm, skipped = gradient_norm(params)
    # GNS: after the last micro-step (and DDP's all-reduce), before unscaling (the estimators divide it out)
    examples_this_step = gradient_accumulation_steps * batch_size * ddp_world_size  # their values read when logged
    gns_collected = gnstracking.collect_all(estimators, iter_num, examples_this_step, scaler, skipped)
    scaler.unscale_(optimizer)
    grad_norm = clip_unscaled(params, grad_clip, grad_norm, scaler)
    nonfinite_on_device = step_unless_nonfinite(optimizer, scaler, grad_norm, nonfinite_on_device, skipped)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    gnstracking.reset_all(estimators)
    raw_model.tokens_processed += tokens_this_step
    tokens_processed += tokens_this_step

    t1 = time.time()  # dt: between logged steps the host's time (nothing waits for the device)
    dt = t1 - t0
    t0 = t1
    if local_iter_num >= 5:  # the first iterations are slow (allocation, compilation)
        mfu = raw_model.estimate_mfu(batch_size * gradient_accumulation_steps * ddp_world_size, dt)
        running_mfu = mfu if running_mfu == -1.0 else 0.9 * running_mfu + 0.1 * mfu
    step_row.update({'iter_num': iter_num, 'tokens_processed': tokens_processed, 'dt': dt, 'tokens_per_sec': tokens_this_step / dt,
                     'mfu': running_mfu, 'lr': lr, 'grad_norm': grad_norm, 'gradient_accumulation_steps': gradient_accumulation_steps,
                     'train/lossf': loss.detach() * gradient_accumulation_steps, 'step_skipped': skipped,
                     'nonfinite_steps': nonfinite_on_device, **(schedule.row() if schedule else {})})
    pending.add(step_row, gns_collected)  # its device values (loss, norm, GNS sums) read when logged
    logs = iter_num % log_interval == 0  # nanoGPT's: the iteration just done, log.csv's step
    iter_num += 1
    local_iter_num += 1
    if last_step and (master_process or fsdp):  # the final evaluation (and checkpoint), on the last step's row
        evaluate_and_checkpoint(step_row)
    # read for the status line, before an evaluation (on every rank alike), and each step for the GNS controller
    if logs or last_step or iter_num % eval_interval == 0 or bs_controller == 'gns' or len(pending) >= pending.LIMIT:
        flush_steps()  # step_row's values are numbers now
        if master_process and logs:
            gns = ", ".join(s for s in (gnstracking.status_line(estimators), schedule and schedule.status()) if s)
            print(f"iter {iter_num - 1}: loss {step_row['train/lossf']:.4f}, time {dt*1000:.2f}ms, mfu {running_mfu*100:.2f}%, tokens "
                  f"{tokens_processed:,}, lr {lr:.3e}, grad_norm {step_row['grad_norm']:.3f}" + (f", {gns}" if gns else ""))
    if not last_step and signals.agreed(ddp, device):  # Ctrl-C, a preemption: on every rank after this step
        flush_steps()
        if (master_process or fsdp) and always_save_checkpoint:
            save_checkpoint()
        if ddp:  # torchrun stops the other ranks once one exits: none leaves before ckpt.pt is written
            torch.distributed.barrier()
        stop_early(stopped_message(signals.received, iter_num - 1, tokens_processed, last_checkpoint, ddp), 128 + signals.received, logger, ddp)

if master_process:
    logger.close()
    if gnstracking.skipped_steps(estimators):
        print(gnstracking.skipped_steps_line(estimators, float16=scaler.is_enabled()))
if ddp:
    torch.distributed.barrier()  # leave together: a rank tearing down while its peer still talks aborts
    destroy_process_group()
    leave(0, distributed=True)
