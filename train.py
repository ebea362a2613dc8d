"""
Train a GPT and measure its gradient noise scale from exact per-example gradient norms: nanoGPT's
training script and flags, plus per-example-norm layers (--linearclass, --embeddingclass,
--lnclass), GNS estimators logged to out_dir/log.csv, training counted in tokens (nanoGPT's
iteration lengths are converted), and an optional batch-size schedule editable mid-run.

$ python train.py config/train_shakespeare_char_cpu.py --lnclass=shim
$ torchrun --standalone --nproc_per_node=4 train.py config/train_cgpt_111M_owt.py
$ torchrun --standalone --nproc_per_node=2 train.py config/train_shakespeare_char_cpu.py --device=cpu --backend=gloo \
      --gradient_accumulation_steps=2
"""
import math
import os
import pickle
import shlex
import signal
import sys
import time
import warnings
from contextlib import nullcontext

import numpy as np
import torch

import gnstracking
from configurator import ConfigError, check_device, check_number, configure, die
from layer_config import FLAG_CLASSES, classes_for_flags, set_contextual_config
from model import GPT, GPTConfig, CheckpointError, load_weights, read_checkpoint, write_checkpoint
from schedules import GradAccumSchedule, lr_at, max_accumulation_steps
from tracker import LogWrapper, LogWriteError, OutDirInUse, lock_out_dir

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
# per-example gradient norm layers, by flag value (layer_config.FLAG_CLASSES): nn (plain torch,
# not measured), gns (norms in the layer's own backward), shim (torch's backward, norms beside it),
# fused (the LayerNorm kernel)
linearclass = 'nn'
embeddingclass = 'nn'
lnclass = 'nn'
# the earlier approximate estimators, logged beside the exact one for comparison (gnshooks.py,
# microbatch_gns.py): hooks on plain nn.Linear layers ('exact' ghost norms or the 'sogns'
# approximation), and the micro-batch estimator (small batch = one micro-step's gradient)
gns_hooks = 'none'  # none, sogns or exact
microbatch_gns = False
# AdamW optimizer. The run's length and the learning-rate schedule are in tokens or, as in
# nanoGPT, in iterations (one unit per length); unset, they are nanoGPT's 600000 iterations of
# training and of decay, and 2000 of warmup
learning_rate = 6e-4
max_tokens = None
max_iters = None  # nanoGPT's: iterations (they also stop a run whose batch-size schedule shortens them)
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0  # clip gradients at this norm, or disable if == 0.0
decay_lr = True
warmup_tokens = None  # linear warmup from 0 to learning_rate
warmup_iters = None
lr_decay_tokens = None  # then linear decay to min_lr by here
lr_decay_iters = None
min_lr = 6e-5
lr_decay_shape = 'linear'  # or 'cosine', nanoGPT's
max_nonfinite_steps = 5  # stop after this many steps in a row with a non-finite gradient (float32/bfloat16)
# batch-size schedule: accumulation steps piecewise linear in tokens, out_dir/grad_accum_schedule.txt
bs_schedule = False
bs_schedule_points = []  # [(tokens, global accumulation steps), ...]; [] = 2 at 0 tokens (as the reference) to gradient_accumulation_steps at max_tokens
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
               if not k.startswith('_') and isinstance(v, (int, float, bool, str, list, type(None)))]
config = {k: globals()[k] for k in config_keys}


# warnings (a resumed log's missing rows, a schedule edit refused) are one line each, like errors
warnings.formatwarning = lambda message, *args, **kwargs: f"warning: {message}\n"


try:
    configure(sys.argv[1:], config, __doc__)
except ConfigError as e:
    die(str(e))
globals().update(config)

# every value is checked here, before anything runs: bad input is one line and exit code 2
CHOICES = {
    'linearclass': tuple(FLAG_CLASSES['linearclass']),
    'embeddingclass': tuple(FLAG_CLASSES['embeddingclass']),
    'lnclass': tuple(FLAG_CLASSES['lnclass']),
    'gns_hooks': ('none', 'sogns', 'exact'),
    'dtype': ('float32', 'bfloat16', 'float16'),
    'lr_decay_shape': ('linear', 'cosine'),
}
for key, choices in CHOICES.items():
    if config[key] not in choices:
        die(f"--{key}={config[key]!r} is not one of {', '.join(choices)}")
if init_from not in ('scratch', 'resume') and not init_from.startswith('gpt2'):
    die(f"--init_from={init_from!r} is not one of scratch, resume, gpt2, gpt2-medium, gpt2-large, gpt2-xl")


for key in ('batch_size', 'block_size', 'n_layer', 'n_head', 'n_embd', 'gradient_accumulation_steps',
            'eval_interval', 'log_interval', 'eval_iters', 'max_nonfinite_steps'):
    check_number(config, key, 1, whole=True)
if n_embd % n_head:
    die(f"--n_embd={n_embd} must be a multiple of --n_head={n_head}")
for key, low, high in (('dropout', 0, 1), ('beta1', 0, 1), ('beta2', 0, 1), ('min_lr', 0, math.inf),
                       ('weight_decay', 0, math.inf), ('grad_clip', 0, math.inf)):
    check_number(config, key, low, high)
check_number(config, 'learning_rate', 0, low_ok=False)
for key in ('max_tokens', 'warmup_tokens', 'lr_decay_tokens', 'max_iters', 'warmup_iters', 'lr_decay_iters'):
    if config[key] is not None:
        check_number(config, key, 1 if key.startswith('max') else 0, whole=key.endswith('iters'))
for key in ('cos_attn', 'spectral_c_attn', 'fp32_attention_layers'):
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_layer for i in config[key]):
        die(f"--{key}={config[key]!r} must list block indices 0..{n_layer - 1}")
if not out_dir or (os.path.exists(out_dir) and not os.path.isdir(out_dir)):
    die(f"--out_dir={out_dir!r} must name a directory")
device_type = check_device(device)

# lengths given in iterations (nanoGPT) become tokens of the configured step
tokens_per_iter = gradient_accumulation_steps * batch_size * block_size
for key, default_iters in (('max', 600000), ('warmup', 2000), ('lr_decay', 600000)):
    tokens, iters = config[f'{key}_tokens'], config[f'{key}_iters']
    if tokens is not None and iters is not None:
        die(f"--{key}_tokens and --{key}_iters set the same length twice; set one of them")
    config[f'{key}_tokens'] = tokens if tokens is not None else (iters if iters is not None else default_iters) * tokens_per_iter
max_tokens, warmup_tokens, lr_decay_tokens = config['max_tokens'], config['warmup_tokens'], config['lr_decay_tokens']


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



if master_process and not eval_only:  # out_dir is this run's alone (eval_only writes nothing there)
    try:
        os.makedirs(out_dir, exist_ok=True)
        out_dir_lock, previous = lock_out_dir(out_dir)
    except OSError as e:
        die(f"cannot write in --out_dir={out_dir} ({e.strerror or e})")
    except OutDirInUse as e:
        die(f"--out_dir={e}")
    if previous:
        print(f"note: taking over {out_dir}/train.lock from {previous}, which is no longer running")
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


model_args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, bias=bias,
                  vocab_size=None, dropout=dropout, cos_attn=cos_attn, spectral_c_attn=spectral_c_attn,
                  fp32_attention_layers=fp32_attention_layers, device_name=device_name)
checkpoint = None
layer_classes = classes_for_flags(linearclass=linearclass, embeddingclass=embeddingclass, lnclass=lnclass)
with set_contextual_config(**layer_classes):
    if init_from == 'scratch':
        print("Initializing a new model from scratch")
        model_args['vocab_size'] = meta_vocab_size if meta_vocab_size is not None else 50304
        model = GPT(GPTConfig(**model_args))
    elif init_from == 'resume':
        ckpt_path = os.path.join(out_dir, 'ckpt.pt')
        print(f"Resuming training from {out_dir}")
        try:
            checkpoint = read_checkpoint(ckpt_path, device)
        except CheckpointError as e:
            die(f"--init_from=resume: {e}")
        # the architecture is the checkpoint's (nanoGPT's and the reference's lack the newer
        # fields, which keep the command line's values); the rest may change on the command line
        for k in ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'vocab_size',
                  'cos_attn', 'spectral_c_attn', 'fp32_attention_layers'):
            model_args[k] = checkpoint['model_args'].get(k, model_args[k])
        model = GPT(GPTConfig(**model_args))
        try:
            iter_num = int(checkpoint.get('iter_num', 0))
            best_val_loss = float(checkpoint.get('best_val_loss', 1e9))
            # nanoGPT's checkpoints count no tokens: its iterations of the step it was configured with
            then = {**config, **checkpoint.get('config', {})}
            counted = iter_num * int(then['gradient_accumulation_steps'] * then['batch_size'] * then['block_size'])
            for note in load_weights(model, checkpoint['model'], tokens_processed=counted):
                print(f"note: {note}")
        except (CheckpointError, TypeError, ValueError) as e:
            die(f"--init_from=resume: {ckpt_path}: {e}")
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

scaler = torch.amp.GradScaler(device_type, enabled=(dtype == 'float16'))
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if checkpoint is not None:
    try:
        optimizer.load_state_dict(checkpoint['optimizer'])
    except (KeyError, ValueError, RuntimeError) as e:
        die(f"--init_from=resume: the optimizer state in {ckpt_path} does not fit this model ({str(e)[:120]})")
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

# the GNS estimators (gnstracking.py): the exact per-example one whenever a layer measures, the DDP
# one under DDP, the Linear hooks and the micro-batch one when asked; their live EMAs resume
estimators = gnstracking.estimators_for(raw_model, ddp_model=model if ddp else None, world_size=ddp_world_size,
                                        hooks=gns_hooks, microbatch=microbatch_gns)
if checkpoint is not None:
    gnstracking.load_states(estimators, checkpoint)
if gns_hooks != 'none' and compile:
    print("note: with --gns_hooks the compiled model runs its forward eagerly (dynamo cannot trace the hooks)")

schedule = None
if bs_schedule:
    # a step never takes more micro-steps than reach max_tokens: a larger count in the file is refused
    max_steps = max_accumulation_steps(max_tokens, batch_size, block_size, ddp_world_size)
    end = min(tokens_per_iter // (batch_size * block_size), max_steps)  # the configured (global) accumulation
    points = bs_schedule_points or [(0, min(2, end)), (max_tokens, end)]
    try:
        # every rank reads the file; only the master writes the default one
        schedule_path = os.path.join(out_dir, 'grad_accum_schedule.txt')
        if master_process:
            GradAccumSchedule(schedule_path, points, max_steps=max_steps)
        if ddp:
            torch.distributed.barrier()
        schedule = GradAccumSchedule(schedule_path, max_steps=max_steps, log=print if master_process else (lambda *a: None))
    except (ValueError, FileNotFoundError) as e:
        die(str(e))


def scheduled_accumulation_steps(tokens):
    """The schedule's accumulation steps per process at `tokens`; every rank takes rank 0's count
    (ranks may read the file either side of an edit)."""
    steps = schedule.steps_at(tokens, ddp_world_size)
    if ddp:
        count = torch.tensor([steps], device=device)
        torch.distributed.broadcast(count, 0)
        steps = int(count.item())
    return steps


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
    """ckpt.pt, never from non-finite weights; a failed write (a full disk) stops the run."""
    global last_checkpoint
    if not torch.stack([torch.isfinite(p).all() for p in params]).all():
        print(f"not saving a checkpoint: the weights are not finite; ckpt.pt keeps {last_checkpoint}")
        return
    ckpt = {
        'model': raw_model.state_dict(),
        'optimizer': optimizer.state_dict(),
        'scaler': scaler.state_dict(),
        'model_args': model_args,
        'iter_num': iter_num,
        'best_val_loss': best_val_loss,
        'config': config,
    }
    gnstracking.save_states(estimators, ckpt)
    print(f"saving checkpoint to {out_dir}")
    try:
        write_checkpoint(ckpt, os.path.join(out_dir, 'ckpt.pt'))
    except CheckpointError as e:
        stop(f"{e}; ckpt.pt keeps {last_checkpoint}", code=1)
    last_checkpoint = f"iter {iter_num}"


def evaluate_and_checkpoint():
    global best_val_loss
    losses = estimate_loss()
    print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    # eval_tokens: what the evaluated model has seen (the row's tokens_processed counts its step too,
    # which comes after the row's evaluation, except for the final evaluation)
    logger.log({'train/loss': losses['train'], 'val/loss': losses['val'], 'eval_tokens': tokens_processed})
    if losses['val'] < best_val_loss or always_save_checkpoint:
        best_val_loss = min(best_val_loss, losses['val'])
        if local_iter_num > 0:  # nothing new to save before this process has taken a step
            save_checkpoint()


def finished(tokens, iters):
    return tokens >= max_tokens or (max_iters is not None and iters >= max_iters)


def stop(message, code):
    """End the run early with one line: the log is complete up to the last finished step."""
    if master_process:
        print(message, file=sys.stderr)
        logger.log_dict.clear()  # the unfinished step's values: its row is redone on resume
        logger.close()
    sys.exit(code)


def log_step():
    """Write this step's row; a full disk (or any failed write) ends the run with one line,
    log.csv left with its complete rows for --init_from=resume."""
    try:
        logger.step()
    except LogWriteError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


# SIGINT (Ctrl-C) and SIGTERM (a cluster's preemption) end the run after the step under way, with
# a checkpoint where the run saves them anyway; a second signal stops at once
stop_signal = 0


def on_signal(signum, frame):
    global stop_signal
    if stop_signal:
        print(f"\n{signal.Signals(signum).name} again: stopping now; ckpt.pt keeps {last_checkpoint}", file=sys.stderr)
        os._exit(128 + signum)
    stop_signal = signum
    if master_process:
        print(f"\n{signal.Signals(signum).name}: stopping after this step (send it again to stop now)", file=sys.stderr)


signal.signal(signal.SIGINT, on_signal)
signal.signal(signal.SIGTERM, on_signal)


def stop_if_asked():
    """After a step: stop the run, with one line, after max_nonfinite_steps skipped steps in a row
    or on a signal (every rank after the same step: the signal may reach them at different ones)."""
    global stop_signal
    if nonfinite_steps >= max_nonfinite_steps:
        stop(f"stopping at iter {iter_num}: the last {nonfinite_steps} steps had a non-finite loss or gradient "
             f"and were skipped (the run diverged: try a lower --learning_rate); ckpt.pt keeps {last_checkpoint}", code=1)
    if ddp:
        flag = torch.tensor([stop_signal], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        stop_signal = int(flag.item())
    if stop_signal:
        if master_process and always_save_checkpoint:
            save_checkpoint()
        command = ' '.join(shlex.quote(a) for a in sys.argv if not a.startswith('--init_from='))
        resume = (f"the torchrun command that started it, with --init_from=resume" if ddp
                  else f"python {command} --init_from=resume")
        stop(f"stopped by {signal.Signals(stop_signal).name} after iter {iter_num} ({tokens_processed:,} tokens); "
             f"ckpt.pt holds {last_checkpoint}; to go on: {resume}", code=128 + stop_signal)

# out_dir/log.csv (one row per iteration, crash-safe), config.json, and wandb if asked for;
# eval_only writes neither (it must not replace a training run's log or config)
logger = None
if master_process:
    try:
        logger = LogWrapper(config=config, out_dir=None if eval_only else out_dir,
                            resume_step=iter_num if init_from == 'resume' else None,
                            wandb_log=wandb_log, wandb_project=wandb_project, wandb_run_name=wandb_run_name)
    except (ValueError, OSError) as e:
        die(f"--init_from=resume: {e}" if init_from == 'resume' else str(e))

params = [p for p in raw_model.parameters() if p.requires_grad]
last_checkpoint = f"iter {iter_num}" if init_from == 'resume' else "nothing (none was written)"
# a host copy of the model's tokens_processed buffer: reading the device buffer would sync
tokens_processed = int(raw_model.tokens_processed)
X, Y = get_batch('train')
t0 = time.time()
local_iter_num = 0  # iterations of this process (MFU skips the first, slow ones)
running_mfu = -1.0
nonfinite_steps = 0  # steps in a row whose gradient was not finite (float32/bfloat16: skipped)
while eval_only or not finished(tokens_processed, iter_num):
    if schedule is not None:
        gradient_accumulation_steps = scheduled_accumulation_steps(tokens_processed)
    tokens_this_step = gradient_accumulation_steps * tokens_per_micro_step
    lr = lr_at(tokens_processed + tokens_this_step, learning_rate, min_lr,
               warmup_tokens, lr_decay_tokens, decay_lr, lr_decay_shape)
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr
    last_step = finished(tokens_processed + tokens_this_step, iter_num + 1)

    # the last step's evaluation comes after it (below): readers of log.csv find GNS on every row
    if master_process and (eval_only or (iter_num % eval_interval == 0 and not last_step)):
        evaluate_and_checkpoint()
    if eval_only:
        if master_process:
            log_step()  # to wandb only
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

    # GNS: after the last micro-step (and DDP's all-reduce), before unscaling and clipping, on every
    # rank; the estimators divide the loss scale out themselves
    examples_this_step = gradient_accumulation_steps * batch_size * ddp_world_size
    gns_row = gnstracking.measure_all(estimators, iter_num, examples_this_step, scaler)
    scaler.unscale_(optimizer)
    # the norm is computed (and logged) whether or not it clips
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0.0 else float('inf'))
    grad_normf = grad_norm.item()  # the same on every rank: DDP has averaged the gradients
    if scaler.is_enabled() or math.isfinite(grad_normf):
        scaler.step(optimizer)  # GradScaler skips a float16 step that overflowed by itself
        nonfinite_steps = 0
    else:  # float32/bfloat16: a step from non-finite gradients would ruin the weights: skip it
        nonfinite_steps += 1
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    gnstracking.reset_all(estimators)
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
        logger.log({'iter_num': iter_num, 'tokens_processed': tokens_processed, 'dt': dt,
                    'tokens_per_sec': tokens_this_step / dt, 'mfu': running_mfu, 'lr': lr,
                    'grad_norm': grad_normf, 'gradient_accumulation_steps': gradient_accumulation_steps,
                    'train/lossf': lossf})
        logger.log(gns_row)
        if (iter_num + 1) % log_interval == 0:
            gns = gnstracking.status_line(estimators)
            print(f"iter {iter_num + 1}: loss {lossf:.4f}, time {dt*1000:.2f}ms, mfu {running_mfu*100:.2f}%, "
                  f"tokens {tokens_processed:,}, lr {lr:.3e}, grad_norm {grad_normf:.3f}" + (f", {gns}" if gns else ""))
    iter_num += 1
    local_iter_num += 1
    if master_process:
        if last_step:  # the final evaluation (and checkpoint), on the last step's row
            evaluate_and_checkpoint()
        log_step()
    if not last_step:
        stop_if_asked()

if master_process:
    logger.close()
    if gnstracking.skipped_steps(estimators):
        why = ("float16 overflow: GradScaler skipped them" if scaler.is_enabled()
               else "non-finite gradients: the optimizer skipped them")
        print(f"GNS: {gnstracking.skipped_steps(estimators)} step(s) were not measured ({why})")
    if not eval_only:
        out_dir_lock.truncate(0)  # a clean end: the next run finds no holder to take over from
if ddp:
    # leave together: a gloo rank tearing down while its peer still talks can abort the process
    torch.distributed.barrier()
    destroy_process_group()
