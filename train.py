"""
Train a GPT and measure its gradient noise scale from exact per-example gradient norms.

nanoGPT's training script and flags, plus: training denominated in tokens (max_tokens,
warmup_tokens, lr_decay_tokens), per-example-norm layers chosen with --linearclass,
--embeddingclass and --lnclass, GNS tracking into out_dir/log.csv, and an optional
batch-size schedule read from out_dir/grad_accum_schedule.txt, editable mid-run.

Single process, e.g. on CPU:
$ python train.py config/train_shakespeare_char_cpu.py --lnclass=shim

DDP on 4 GPUs of one node:
$ torchrun --standalone --nproc_per_node=4 train.py config/train_cgpt_111M_owt.py

DDP on CPU (2 processes):
$ torchrun --standalone --nproc_per_node=2 train.py config/train_shakespeare_char_cpu.py --device=cpu --backend=gloo \
      --gradient_accumulation_steps=2
"""
import os
import sys
import time
import pickle
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn

from configurator import ConfigError, configure

# -----------------------------------------------------------------------------
# default config values: a GPT-2 (124M) on OpenWebText, as in nanoGPT
# I/O
out_dir = 'out'
eval_interval = 2000
log_interval = 1
eval_iters = 200
eval_only = False  # if True, exit right after the first eval
always_save_checkpoint = True  # if True, save a checkpoint after each eval, not only on improvement
init_from = 'scratch'  # 'scratch' or 'resume' or 'gpt2*'
# wandb logging
wandb_log = False
wandb_project = 'owt'
wandb_run_name = 'gpt2'
# data
dataset = 'openwebtext'  # a folder under data/ (or a path to one) holding train.bin, val.bin
gradient_accumulation_steps = 5 * 8  # global: divided across DDP ranks
batch_size = 12  # micro-batch size per process
block_size = 1024
# model
n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = False
cos_attn = []  # block indices with cosine attention
spectral_c_attn = []  # block indices with spectral-normalised Q/K/V
fp32_attention_layers = []  # block indices whose attention runs in float32
device_name = 'A100'  # peak-FLOPs entry for MFU (see model.PEAK_FLOPS)
# per-example gradient norm layers: nn (plain torch, not measured), gns (fused), shim
linearclass = 'nn'
embeddingclass = 'nn'
lnclass = 'nn'  # nn, shim (separated LayerNorm) or fused (fused kernel)
# the earlier approximate estimators, logged beside the exact one for comparison (gnshooks.py,
# microbatch_gns.py): hooks on plain nn.Linear layers ('exact' ghost norms or the 'sogns'
# approximation), and the micro-batch estimator (small batch = one micro-step's gradient)
gns_hooks = 'none'  # none, sogns or exact
microbatch_gns = False
# AdamW optimizer; schedules are in tokens
learning_rate = 6e-4
max_tokens = 600000 * 491520  # nanoGPT's 600k iterations of ~0.5M tokens
max_iters = 0  # if > 0, also stop after this many iterations
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0  # clip gradients at this norm, or disable if == 0.0
decay_lr = True
warmup_tokens = 2000 * 491520
lr_decay_tokens = 600000 * 491520  # linear decay to min_lr by here
min_lr = 6e-5
# batch-size schedule: accumulation steps piecewise linear in tokens, out_dir/grad_accum_schedule.txt
bs_schedule = False
bs_schedule_points = []  # [(tokens, global accumulation steps), ...]; [] = 1 at 0 tokens to gradient_accumulation_steps at max_tokens
# system
backend = 'nccl'  # 'nccl' for GPUs, 'gloo' for CPU
device = 'cuda'  # 'cpu', 'cuda', 'cuda:1', 'mps'
# float32, bfloat16 or float16 (autocast, also on CPU); without CUDA the default is float32, as
# nanoGPT trains on CPU (float16 autocast on a CPU is emulated and many times slower)
dtype = ('bfloat16' if torch.cuda.is_bf16_supported() else 'float16') if torch.cuda.is_available() else 'float32'
compile = True
seed = 1337
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items()
               if not k.startswith('_') and isinstance(v, (int, float, bool, str, list))]
config = {k: globals()[k] for k in config_keys}


def die(msg):
    """Bad input: one line on stderr and a non-zero exit, never a traceback."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


try:
    configure(sys.argv[1:], config, __doc__)
except ConfigError as e:
    die(str(e))
globals().update(config)

LAYER_CHOICES = {
    'linearclass': ('nn', 'gns', 'shim'),
    'embeddingclass': ('nn', 'gns', 'shim'),
    'lnclass': ('nn', 'shim', 'fused'),
    'gns_hooks': ('none', 'sogns', 'exact'),
}
for key, choices in LAYER_CHOICES.items():
    if config[key] not in choices:
        die(f"--{key}={config[key]!r} is not one of {', '.join(choices)}")
if dtype not in ('float32', 'bfloat16', 'float16'):
    die(f"--dtype={dtype!r} is not one of float32, bfloat16, float16")
if init_from not in ('scratch', 'resume') and not init_from.startswith('gpt2'):
    die(f"--init_from={init_from!r} is not one of scratch, resume, gpt2, gpt2-medium, gpt2-large, gpt2-xl")
device_type = 'cuda' if 'cuda' in device else ('mps' if 'mps' in device else 'cpu')
if device_type == 'cuda' and not torch.cuda.is_available():
    die(f"--device={device} but CUDA is not available here; use --device=cpu (and --backend=gloo with torchrun)")


def layer_classes():
    """The Linear / Embedding / LayerNorm classes chosen on the command line."""
    import buffered
    linear = {'nn': nn.Linear, 'gns': 'PEGradNormLinear', 'shim': 'PEGradNormShimLinear'}[linearclass]
    embedding = {'nn': nn.Embedding, 'gns': 'PEGradNormEmbedding', 'shim': 'PEGradNormShimEmbedding'}[embeddingclass]
    layernorm = {'nn': nn.LayerNorm, 'shim': 'PEGradNormSeparatedLayerNorm'}.get(lnclass)
    if lnclass == 'fused':
        from fused_gns import PEGradNormFusedLayerNorm as layernorm
    resolve = lambda c: getattr(buffered, c) if isinstance(c, str) else c
    return dict(Linear=resolve(linear), Embedding=resolve(embedding), LayerNorm=resolve(layernorm))


# DDP: a torchrun launch sets RANK
ddp = int(os.environ.get('RANK', -1)) != -1
if ddp:
    from torch.distributed import init_process_group, destroy_process_group
    from torch.nn.parallel import DistributedDataParallel as DDP
    init_process_group(backend=backend)
    ddp_rank = int(os.environ['RANK'])
    ddp_local_rank = int(os.environ['LOCAL_RANK'])
    ddp_world_size = int(os.environ['WORLD_SIZE'])
    if device_type == 'cuda':
        device = f'cuda:{ddp_local_rank}'
        torch.cuda.set_device(device)
    master_process = ddp_rank == 0  # this process logs and checkpoints
    seed_offset = ddp_rank  # each process gets a different seed
    if gradient_accumulation_steps % ddp_world_size != 0 and not bs_schedule:
        die(f"gradient_accumulation_steps={gradient_accumulation_steps} is not divisible by the {ddp_world_size} DDP processes "
            f"(it counts micro-steps over all processes: use --gradient_accumulation_steps={ddp_world_size} or a multiple)")
    gradient_accumulation_steps //= ddp_world_size
else:
    master_process = True
    seed_offset = 0
    ddp_world_size = 1
    ddp_rank = 0
tokens_per_micro_step = ddp_world_size * batch_size * block_size
print(f"tokens per iteration will be: {gradient_accumulation_steps * tokens_per_micro_step:,}")

if master_process:
    os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(seed + seed_offset)
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
ctx = nullcontext() if dtype == 'float32' else torch.autocast(device_type=device_type, dtype=ptdtype)

# poor man's data loader: memory-map the token file anew each batch (avoids a memmap leak)
data_dir = dataset if os.path.isdir(dataset) else os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', dataset)
for split in ('train', 'val'):
    if not os.path.exists(os.path.join(data_dir, f'{split}.bin')):
        die(f"dataset {dataset!r} is not prepared ({os.path.join(data_dir, split + '.bin')} is missing); "
            f"run: python data/{dataset}/prepare.py")


def get_batch(split, rng=None):
    data = np.memmap(os.path.join(data_dir, f'{split}.bin'), dtype=np.uint16, mode='r')
    if len(data) <= block_size:
        die(f"{split}.bin holds {len(data)} tokens, too few for block_size={block_size}")
    # every rank draws the whole global micro-batch from the same generator and keeps its own
    # slice, so the examples of a step do not depend on how many processes share them: a 2-rank
    # run sees exactly the batches of a 1-process run with twice the batch_size
    ix = torch.randint(len(data) - block_size, (ddp_world_size * batch_size,),
                       generator=rng or batch_rng[split])
    ix = ix[ddp_rank * batch_size:(ddp_rank + 1) * batch_size]
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    if device_type == 'cuda':
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


iter_num = 0
best_val_loss = 1e9

# vocab size from the dataset's meta.pkl (character-level datasets), else GPT-2's padded 50304
meta_path = os.path.join(data_dir, 'meta.pkl')
meta_vocab_size = None
if os.path.exists(meta_path):
    with open(meta_path, 'rb') as f:
        meta_vocab_size = pickle.load(f)['vocab_size']
    print(f"found vocab_size = {meta_vocab_size} (inside {meta_path})")

from model import GPT, GPTConfig  # noqa: E402  (after the config: model prints nothing at import)
from layer_config import set_contextual_config  # noqa: E402

model_args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, bias=bias,
                  vocab_size=None, dropout=dropout, cos_attn=cos_attn, spectral_c_attn=spectral_c_attn,
                  fp32_attention_layers=fp32_attention_layers, device_name=device_name)
checkpoint = None
with set_contextual_config(**layer_classes()):
    if init_from == 'scratch':
        print("Initializing a new model from scratch")
        model_args['vocab_size'] = meta_vocab_size if meta_vocab_size is not None else 50304
        model = GPT(GPTConfig(**model_args))
    elif init_from == 'resume':
        ckpt_path = os.path.join(out_dir, 'ckpt.pt')
        if not os.path.exists(ckpt_path):
            die(f"--init_from=resume but there is no checkpoint at {ckpt_path}")
        print(f"Resuming training from {out_dir}")
        checkpoint = torch.load(ckpt_path, map_location=device, weights_only=False)
        # the architecture must match the checkpoint; the rest may be changed on the command line
        for k in ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'vocab_size',
                  'cos_attn', 'spectral_c_attn', 'fp32_attention_layers'):
            model_args[k] = checkpoint['model_args'][k]
        model = GPT(GPTConfig(**model_args))
        state_dict = checkpoint['model']
        prefix = '_orig_mod.'  # left by torch.compile in older checkpoints
        state_dict = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state_dict.items()}
        model.load_state_dict(state_dict)
        iter_num = checkpoint['iter_num']
        best_val_loss = checkpoint['best_val_loss']
    else:
        print(f"Initializing from OpenAI GPT-2 weights: {init_from}")
        try:
            model = GPT.from_pretrained(init_from, dict(dropout=dropout))
        except Exception as e:  # no transformers package, or no network to the model hub
            die(f"--init_from={init_from} needs the transformers package and network access to "
                f"download the weights, and that failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        for k in ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'vocab_size'):
            model_args[k] = getattr(model.config, k)
if block_size < model.config.block_size:
    model.crop_block_size(block_size)
    model_args['block_size'] = block_size
model.to(device)
# data order: seeded by the iteration we start from, so a resumed run does not replay the start
# evaluation (on the master alone) draws from generators of its own, so the training batches of
# all ranks stay in step
batch_rng = {'train': torch.Generator().manual_seed(seed * 1_000_003 + iter_num)}
eval_rng = {split: torch.Generator().manual_seed(seed * 1_000_003 + iter_num + k + 1) for k, split in enumerate(('train', 'val'))}

import gnshooks  # noqa: E402
from microbatch_gns import MicrobatchGNS  # noqa: E402
hooks_kind = {'none': None, 'sogns': gnshooks.add_sogns_hooks, 'exact': gnshooks.add_exact_hooks}[gns_hooks]
if hooks_kind is not None:
    gnshooks.add_hooks_to_model(model, hooks_kind)
    if compile:
        print("note: with --gns_hooks the compiled model runs its forward eagerly (dynamo cannot trace the hooks)")
microbatch = MicrobatchGNS(model) if microbatch_gns else None

scaler = torch.amp.GradScaler(device_type, enabled=(dtype == 'float16'))
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if checkpoint is not None:
    optimizer.load_state_dict(checkpoint['optimizer'])
    if 'scaler' in checkpoint:
        scaler.load_state_dict(checkpoint['scaler'])
raw_model = model  # the module whose state is checkpointed, whatever wraps it below
if compile:
    print("compiling the model... (takes a ~minute)")
    model = torch.compile(model)
eval_model = model  # evaluation runs on the master alone, so it must not go through DDP
if ddp:
    # broadcast_buffers=False: every rank keeps its own per-example-norm buffers (rank 0's must
    # not overwrite the others' each forward), and tokens_processed advances alike everywhere
    model = DDP(model, device_ids=[ddp_local_rank] if device_type == 'cuda' else None,
                broadcast_buffers=False)

from schedules import GradAccumSchedule, lr_at  # noqa: E402
from buffered import find_sqgradnorm_buffers, zero_sqgradnorm_buffers  # noqa: E402
from gnstracking import AccumulateMeasurements, MeasurementTracker  # noqa: E402
from tracker import LogWrapper  # noqa: E402
import ddpgns  # noqa: E402

# GNS from exact per-example norms: every parameter whose layer measures it
gns_logs = AccumulateMeasurements(prefix='train/gns')
gns_tracker = None
if find_sqgradnorm_buffers(raw_model):
    gns_tracker = MeasurementTracker.from_model(raw_model, callback=gns_logs, scaler=scaler,
                                                world_size=ddp_world_size)
# a live estimate for the status line only (gns-analysis.py re-derives everything from the CSV),
# smoothed as gns-analysis.py smooths by default (alpha 0.99) and carried across a resume, so
# its last value is the analysis' total GNS
live_gns = ddpgns.GradientNoiseScale(beta=0.99)
if checkpoint is not None and 'live_gns' in checkpoint:
    live_gns.load_state_dict(checkpoint['live_gns'])
# the cheap DDP estimator (small batch = one rank's batch), beside the per-example one
ddp_gns = None
if ddp and ddp_world_size > 1:
    ddp_gns_hook = ddpgns.DDPGradientStatsHook(model)
    ddp_gns = ddpgns.GradientNoiseScale()
    if checkpoint is not None and 'ddp_gns' in checkpoint:
        ddp_gns.load_state_dict(checkpoint['ddp_gns'])

schedule = None
if bs_schedule:
    points = bs_schedule_points or [(0, 1), (max_tokens, gradient_accumulation_steps * ddp_world_size)]
    try:
        # every rank reads the file; only the master writes the default one
        schedule_path = os.path.join(out_dir, 'grad_accum_schedule.txt')
        if master_process:
            GradAccumSchedule(schedule_path, points)
        if ddp:
            torch.distributed.barrier()
        schedule = GradAccumSchedule(schedule_path, log=print if master_process else (lambda *a: None))
    except (ValueError, FileNotFoundError) as e:
        die(str(e))


@torch.no_grad()
def estimate_loss():
    """Mean loss over eval_iters batches of each split."""
    out = {}
    eval_model.eval()
    for split in ['train', 'val']:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split, eval_rng[split])
            with ctx:
                logits, loss = eval_model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    eval_model.train()
    return out


def save_checkpoint():
    """Write ckpt.pt atomically: a crash mid-write leaves the previous checkpoint intact."""
    ckpt = {
        'model': raw_model.state_dict(),
        'optimizer': optimizer.state_dict(),
        'scaler': scaler.state_dict(),
        'model_args': model_args,
        'iter_num': iter_num,
        'best_val_loss': best_val_loss,
        'config': config,
    }
    if ddp_gns is not None:
        ckpt['ddp_gns'] = ddp_gns.state_dict()
    ckpt['live_gns'] = live_gns.state_dict()
    path = os.path.join(out_dir, 'ckpt.pt')
    print(f"saving checkpoint to {out_dir}")
    torch.save(ckpt, path + '.tmp')
    os.replace(path + '.tmp', path)


def evaluate_and_checkpoint():
    global best_val_loss
    losses = estimate_loss()
    print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    logger.log({'train/loss': losses['train'], 'val/loss': losses['val']})
    if losses['val'] < best_val_loss or always_save_checkpoint:
        best_val_loss = min(best_val_loss, losses['val'])
        if local_iter_num > 0:  # nothing new to save before this process has taken a step
            save_checkpoint()
    return losses


def finished():
    return tokens_processed >= max_tokens or (max_iters > 0 and iter_num >= max_iters)


# out_dir/log.csv (one row per iteration, crash-safe), config.json, and wandb if asked for
logger = None
if master_process:
    logger = LogWrapper(config=config, out_dir=out_dir,
                        resume_step=iter_num if init_from == 'resume' else None,
                        wandb_log=wandb_log, wandb_project=wandb_project, wandb_run_name=wandb_run_name)

params = [p for p in raw_model.parameters() if p.requires_grad]
# a host copy of the model's tokens_processed buffer: reading the device buffer would sync
tokens_processed = int(raw_model.tokens_processed)
X, Y = get_batch('train')
t0 = time.time()
local_iter_num = 0  # iterations of this process (MFU skips the first, slow ones)
running_mfu = -1.0
while not finished():
    if schedule is not None:
        gradient_accumulation_steps = schedule.steps_at(tokens_processed, ddp_world_size)
    tokens_this_step = gradient_accumulation_steps * tokens_per_micro_step
    lr = lr_at(tokens_processed + tokens_this_step, learning_rate, min_lr,
               warmup_tokens, lr_decay_tokens, decay_lr)
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr

    if iter_num % eval_interval == 0 and master_process:
        evaluate_and_checkpoint()
        if eval_only:
            logger.log({'iter_num': iter_num, 'tokens_processed': tokens_processed})
            logger.step()
            break

    # forward/backward with gradient accumulation; the per-example-norm layers add into their
    # buffers on every micro-step
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            # sync gradients only on the last micro-step (nanoGPT's no_sync shortcut)
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps  # the loss of the whole step is a mean
        X, Y = get_batch('train')  # prefetch the next batch while the GPU works
        scaler.scale(loss).backward()

    # GNS measurements: after the last micro-step, before unscaling and clipping (the tracker
    # divides the loss scale out of gradients and buffers itself)
    examples_this_step = gradient_accumulation_steps * batch_size * ddp_world_size
    if ddp_gns is not None:  # every rank: one collective
        n_small = gradient_accumulation_steps * batch_size
        sq_small, sq_big = ddp_gns_hook.get_sq_norms(loss_scale=scaler.get_scale())
        ddp_gns.update(sq_small, sq_big, n_small, examples_this_step)
    if gns_tracker is not None:
        if ddp:  # per-example sums over the global batch, not one rank's
            ddpgns.allreduce_sqgradnorm_buffers(raw_model)
        measurements = gns_tracker.step(batch_size=examples_this_step, step=iter_num)
        if measurements:
            live_gns.update(sum(m.small_batch_norm ** 2 for m in measurements),
                            sum(m.big_batch_norm ** 2 for m in measurements), 1, examples_this_step)

    scaler.unscale_(optimizer)
    approx_logs = {}  # the approximate estimators read unscaled gradients; every rank calls them
    if hooks_kind is not None:
        approx_logs.update(gnshooks.hook_measurements(raw_model, gns_hooks, loss_scale=scaler.get_scale()))
    if microbatch is not None:
        approx_logs.update(microbatch.measurements(batch_size, loss_scale=scaler.get_scale()))
    # the norm is computed (and logged) whether or not it clips
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0.0 else float('inf'))
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    zero_sqgradnorm_buffers(raw_model)
    if hooks_kind is not None:
        gnshooks.zero_hook_results(raw_model)
    if microbatch is not None:
        microbatch.zero()
    raw_model.tokens_processed += tokens_this_step
    tokens_processed += tokens_this_step

    t1 = time.time()
    dt = t1 - t0
    t0 = t1
    if master_process:
        lossf = loss.item() * gradient_accumulation_steps  # one CPU-GPU sync per step
        if local_iter_num >= 5:  # the first iterations are slow (allocation, compilation)
            mfu = raw_model.estimate_mfu(batch_size * gradient_accumulation_steps * ddp_world_size, dt)
            running_mfu = mfu if running_mfu == -1.0 else 0.9 * running_mfu + 0.1 * mfu
        grad_normf = grad_norm.item()
        logger.log({'iter_num': iter_num, 'tokens_processed': tokens_processed, 'dt': dt,
                    'tokens_per_sec': tokens_this_step / dt, 'mfu': running_mfu, 'lr': lr,
                    'grad_norm': grad_normf, 'gradient_accumulation_steps': gradient_accumulation_steps,
                    'train/lossf': lossf})
        logger.log(gns_logs.pop())
        logger.log(approx_logs)
        if ddp_gns is not None:
            logger.log(ddpgns.ddp_gns_log(ddp_gns, sq_small, sq_big, n_small, examples_this_step))
        if (iter_num + 1) % log_interval == 0:
            gns_msg = f", gns {live_gns.get_gns():.4g}" if gns_tracker is not None else ""
            if ddp_gns is not None:
                gns_msg += f", ddp gns {ddp_gns.get_gns():.4g}"
            print(f"iter {iter_num + 1}: loss {lossf:.4f}, time {dt*1000:.2f}ms, mfu {running_mfu*100:.2f}%, "
                  f"tokens {tokens_processed:,}, lr {lr:.3e}, grad_norm {grad_normf:.3f}{gns_msg}")
        logger.step()
    iter_num += 1
    local_iter_num += 1

# final evaluation on the last iteration
if master_process:
    if not eval_only:
        evaluate_and_checkpoint()
        logger.log({'iter_num': iter_num, 'tokens_processed': tokens_processed})
        logger.step()
    logger.close()
    if gns_tracker is not None and gns_tracker.skipped_steps:
        print(f"GNS: {gns_tracker.skipped_steps} step(s) with inf/nan gradients (fp16 overflow) were not measured")

if ddp:
    destroy_process_group()
