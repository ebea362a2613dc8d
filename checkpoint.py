"""
A training run's state on disk, out_dir/ckpt.pt: building train.py's model (from scratch, from a
checkpoint, from GPT-2's weights), writing the checkpoint atomically and never from non-finite
weights, and reading this fork's, nanoGPT's and the reference implementation's
(CerebrasResearch/nanoGNS) checkpoints. Under FSDP the state is gathered to and scattered from
the shards, and saved in the single-process format, so a checkpoint loads anywhere.
"""
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import zipfile
from dataclasses import fields

import torch

from configurator import dataset_folder
from model import ARCHITECTURE_CHOICES, GPT, GPTConfig
from nanogns.runlog import atomic_write, logged_row


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message is one line for the user."""


def why(error, limit=160):
    """An exception's first line for a one-line message: at most `limit` characters, cut after a
    whole word (marked ...) rather than in the middle of one; its type's name if it says nothing."""
    lines = str(error).strip().splitlines()
    if not lines:
        return type(error).__name__
    line = lines[0]
    if len(line) <= limit:
        return line
    return line[:limit + 1].rsplit(' ', 1)[0].rstrip(' ,;:') + ' ...'


# what a GPT cannot be built without; the other GPTConfig fields default when a checkpoint lacks them
REQUIRED_MODEL_ARGS = ('n_layer', 'n_head', 'n_embd', 'block_size', 'vocab_size')


def read_checkpoint(path, device='cpu'):
    """The dict in a ckpt.pt, or CheckpointError if it is missing, damaged (its bytes do not match the
    CRC-32s saved with them: damaged_record) or not a training checkpoint."""
    if not os.path.isfile(path):
        raise CheckpointError(f"there is no checkpoint at {path}")
    try:
        checkpoint = torch.load(path, map_location=device, weights_only=False)
    except Exception as e:  # truncated, empty, random bytes: torch and pickle raise many kinds
        raise CheckpointError(f"{path} cannot be read, it is damaged or not a checkpoint ({why(e)})") from None
    damaged = damaged_record(path)
    if damaged:
        what = "the pickled values" if damaged.endswith('.pkl') else "a tensor's bytes"
        raise CheckpointError(f"{path} is damaged: its record {damaged} ({what}) does not match the CRC-32 saved with "
                              f"it; restore it from a copy, or start the run again")
    if not (isinstance(checkpoint, dict) and isinstance(checkpoint.get('model'), dict)
            and isinstance(checkpoint.get('model_args'), dict)):
        raise CheckpointError(f"{path} is not a training checkpoint (no 'model' and 'model_args' in it)")
    missing = [k for k in REQUIRED_MODEL_ARGS if k not in checkpoint['model_args']]
    if missing:
        raise CheckpointError(f"{path} lacks model_args {', '.join(missing)}; cannot rebuild its model")
    return checkpoint


def damaged_record(path):
    """
    The name of the first record of the zip file torch.save wrote at path (data.pkl, then a file per
    tensor storage, data/<n>) whose bytes do not match the CRC-32 written beside them, else None.
    torch.save computes them as it writes (torch.serialization.get_crc32_options()), so a save pays
    nothing more for them, but torch.load does not compare them: a file damaged in a tensor's bytes
    loads without an error. None too where there is nothing to compare: a file written without them
    (set_crc32_options(False): every CRC is 0) or not a zip file (torch's legacy format).
    """
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError):
        return None
    with archive:
        records = [info for info in archive.infolist() if info.file_size]
        if not any(info.CRC for info in records):
            return None
        for info in records:
            try:
                with archive.open(info) as f:
                    while f.read(1 << 24):  # zipfile compares the CRC-32 at the record's end
                        pass
            except (zipfile.BadZipFile, OSError, EOFError):  # (also a damaged local header)
                return info.filename.split('/', 1)[-1]
    return None


def write_checkpoint(checkpoint, path):
    """torch.save to path atomically (tracker.atomic_write), so a crash mid-write leaves the previous
    file intact. A failed write (a full disk) leaves no partial file and raises CheckpointError, one
    line saying why."""
    try:
        atomic_write(path, lambda f: torch.save(checkpoint, f))
    except (OSError, RuntimeError) as e:  # torch reports a full disk as a RuntimeError
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
        full = getattr(e, 'errno', None) == errno.ENOSPC or free < (1 << 26)
        reason = f"the disk is full ({free:,} bytes free)" if full else why(e)
        raise CheckpointError(f"cannot write {path}: {reason}") from None


def config_from_checkpoint(model_args):
    """The GPTConfig of a checkpoint's model_args; fields it lacks (nanoGPT's and the reference's
    have fewer) take GPTConfig's defaults, fields this GPT does not know are ignored."""
    known = {f.name for f in fields(GPTConfig)}
    return GPTConfig(**{k: v for k, v in model_args.items() if k in known})


def _state_dict_key(key):
    """This fork's name for a checkpoint key, or None for a key that holds no weight."""
    for prefix in ('_orig_mod.', 'module.'):  # left by torch.compile / a DDP wrapper
        if key.startswith(prefix):
            key = key[len(prefix):]
    if key.endswith('_upegsqnorm'):  # the reference's per-example-norm running sums
        return None
    key = key.replace('.c_attn.qkv.', '.c_attn.')  # the reference wraps c_attn in a FusedQKVLinear
    return re.sub(r'\.(ln_\w+)\.affine\.', r'.\1.', key)  # its separated LayerNorm keeps the gain in .affine


def _holds_no_weight(key, value):
    """Checkpoint entries with no counterpart here that carry nothing to lose: nanoGPT's causal
    mask (torch < 2), the reference's fixed 1.1 Q/K/V scale and its zero 'bias' buffer in a
    separated LayerNorm built with bias=False."""
    if key.endswith('.attn.bias') and value.dim() == 4:
        return True
    if key.endswith('c_attn.scale'):
        return value.numel() == 1 and abs(float(value) - 1.1) < 1e-6
    return re.search(r'\.ln_\w+\.bias$', key) is not None and not value.any()


def load_weights(model, state_dict, tokens_processed=None):
    """
    Load a checkpoint's weights into `model`, whether this fork, nanoGPT or the reference
    implementation wrote it (their key names mapped, per-example-norm buffers dropped). A
    checkpoint without `tokens_processed` (nanoGPT's) gets the given count. Returns notes (what
    was mapped or dropped); raises CheckpointError for anything that does not fit.
    """
    expected = model.state_dict()
    loaded, mapped, dropped = {}, 0, 0
    for key, value in state_dict.items():
        name = _state_dict_key(key)
        if name is None or (name not in expected and _holds_no_weight(name, value)):
            dropped += 1
            continue
        if name not in expected:
            raise CheckpointError(f"the checkpoint has {key!r}, which this GPT does not "
                                  f"(is the checkpoint from another model?)")
        if tuple(value.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{key!r} has shape {tuple(value.shape)} in the checkpoint but "
                                  f"{tuple(expected[name].shape)} here")
        mapped += name != key
        loaded[name] = value
    notes = []
    if 'tokens_processed' not in loaded:
        loaded['tokens_processed'] = torch.tensor(int(tokens_processed or 0), dtype=torch.int64)
        notes.append(f"the checkpoint has no tokens_processed; counting from {int(tokens_processed or 0):,}")
    missing = [k for k in expected if k not in loaded]
    if missing:
        raise CheckpointError(f"the checkpoint lacks {', '.join(missing[:3])}"
                              f"{' and %d more' % (len(missing) - 3) if len(missing) > 3 else ''}")
    # NaN or inf weights make every step non-finite (a resumed run would blame the learning rate) and every sample fail
    spoilt = [k for k, v in loaded.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if spoilt:
        raise CheckpointError(f"the checkpoint holds non-finite weights (NaN or inf in {spoilt[0]}"
                              f"{' and %d more' % (len(spoilt) - 1) if len(spoilt) > 1 else ''}): it is damaged, "
                              f"or was saved by a run that diverged")
    model.load_state_dict(loaded)
    if mapped or dropped:
        notes.append(f"checkpoint keys: {mapped} renamed from another layout (nanoGPT's or the reference's), "
                     f"{dropped} entries without weights dropped")
    return notes


def load_optimizer_state(checkpoint, optimizer, scaler, fsdp_model=None):
    """A resumed run's AdamW (and GradScaler) state; CheckpointError if it does not fit the model.
    fsdp_model: the sharded model the optimizer steps (each rank shards the full state it read)."""
    try:
        saved = _with_this_runs_kernel(checkpoint['optimizer'], optimizer)
        if fsdp_model is None:
            optimizer.load_state_dict(saved)
        else:
            _load_fsdp_optimizer_state(saved, fsdp_model, optimizer)
    except (KeyError, IndexError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"the optimizer state does not fit this model ({why(e, 120)})") from None
    if checkpoint.get('scaler'):  # empty from a run without float16's scaler: a --dtype=float16 resume starts one afresh
        scaler.load_state_dict(checkpoint['scaler'])


def _with_this_runs_kernel(saved, optimizer):
    """The saved optimizer state with each param group's implementation (fused, foreach) set to the
    one this run built: load_state_dict takes them from the checkpoint like the hyperparameters, so
    a checkpoint of an unfused AdamW (nanoGPT's, the reference's, this project's on a CPU before it
    fused there) would switch off the fused step that step_unless_nonfinite skips on the device.
    torch places each state's step count for the group's implementation as it loads it."""
    kernel = {key: optimizer.defaults.get(key) for key in ('fused', 'foreach')}
    groups = saved.get('param_groups') if isinstance(saved, dict) else None
    if not isinstance(groups, list):
        return saved  # load_state_dict says what is wrong
    return {**saved, 'param_groups': [{**group, **kernel} if isinstance(group, dict) else group for group in groups]}


# the architecture of a resumed run is the checkpoint's; other settings may change on the command line
ARCHITECTURE_ARGS = ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'vocab_size',
                     'cos_attn', 'spectral_c_attn', 'fp32_attention_layers',
                     'norm', 'mlp', 'pos_emb', 'tie_embeddings')
# newer than every checkpoint without them: such a checkpoint holds GPT-2's layout, their defaults
LAYOUT_ARGS = tuple(ARCHITECTURE_CHOICES) + ('tie_embeddings',)


def check_resume_flags(path, saved, model_args, places):
    """
    The notes, one line each, of a resume's architecture flags (model_args) that ask for another
    value than the checkpoint's (its model_args, `saved`): a resume trains the checkpoint's model as
    it is, so its value is used; a flag the run sets (places: configure()'s, the keys set in a file
    or on the command line, and where) is said to be replaced, one left unset takes the checkpoint's
    value without a word, as in nanoGPT. block_size, set or not, raises CheckpointError instead: it
    is also the length of the batches, and the lengths in iterations were counted in tokens with it.
    """
    notes = []
    for k in ARCHITECTURE_ARGS:
        theirs = saved.get(k, getattr(GPTConfig, k) if k in LAYOUT_ARGS else None)
        if k == 'vocab_size' or k not in model_args or theirs is None or _plain(model_args[k]) == _plain(theirs):
            continue  # (the vocabulary is the dataset's: check_out_dir_model compares it)
        where = places.get(k, ('the defaults', 0))[0]
        where = {'the command line': 'set on the command line', 'the defaults': 'the default'}.get(where, f"set in {where}")
        flag = lambda value: f"--{k}={value if isinstance(value, str) else repr(value)}"  # noqa: E731
        if k == 'block_size':
            raise CheckpointError(f"{flag(model_args[k])} ({where}), but {path} holds a model of block_size="
                                  f"{theirs!r}, and a resume trains it as it is, on batches of its block_size; "
                                  f"nothing was changed: resume with {flag(theirs)}, or train a model of "
                                  f"{flag(model_args[k])} in another out_dir")
        if k in places:
            notes.append(f"{flag(model_args[k])} ({where}) is not {path}'s {k}={theirs!r}, which this resume uses: "
                         f"a resume trains the checkpoint's model as it is")
    return notes


def resume_model(path, model_args, config, device='cpu', places=None):
    """
    --init_from=resume: (model, checkpoint) from the ckpt.pt at `path`, model_args updated in place
    with the checkpoint's architecture (nanoGPT's and the reference's lack the newer fields, which
    keep model_args' values, except LAYOUT_ARGS: GPTConfig's defaults, the layout those checkpoints
    hold, whatever the run asks for). `config` is the run's, for nanoGPT's checkpoints, which count no
    tokens: they get their iterations of the step they were configured with. places (train.py's:
    where each key was set): the run's architecture flags are compared with the checkpoint's first
    (check_resume_flags). Build it inside the layer config the run measures with. Raises
    CheckpointError, one line.
    """
    checkpoint = read_checkpoint(path, device)
    saved = checkpoint['model_args']
    for note in check_resume_flags(path, saved, model_args, places) if places is not None else ():
        print(f"note: {note}")
    model_args.update({k: saved[k] for k in ARCHITECTURE_ARGS if k in saved})
    model_args.update({k: getattr(GPTConfig, k) for k in LAYOUT_ARGS if k not in saved})
    model = GPT(GPTConfig(**model_args))
    try:
        then = {**config, **checkpoint.get('config', {})}
        steps = int(checkpoint.get('iter_num', 0))
        counted = steps * int(then['gradient_accumulation_steps'] * then['batch_size'] * then['block_size'])
        for note in load_weights(model, checkpoint['model'], tokens_processed=counted):
            print(f"note: {note}")
    except (CheckpointError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from None
    return model, checkpoint


def pretrained_gpt(init_from, dropout):
    """GPT.from_pretrained(init_from), its download's failure (no transformers package, no network to
    the model hub) a CheckpointError of one line."""
    try:
        return GPT.from_pretrained(init_from, dict(dropout=dropout))
    except Exception as e:
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        raise CheckpointError(f"--init_from={init_from} needs the transformers package and network access to "
                              f"download the weights, and that failed: {reason}") from None


def _plain(value):
    return json.loads(json.dumps(value, default=str))  # as config.json holds it: tuples are lists


ROOT = os.path.dirname(os.path.abspath(__file__))  # where train.py resolves a --dataset name (data/<name>)


# a split's content is compared by this many blocks of this many bytes, spread evenly from the file's
# first byte to its last: 1 MiB read per split however large it is (OpenWebText's train.bin is 17 GB)
SAMPLED_BLOCKS, SAMPLED_BLOCK_BYTES = 16, 1 << 16


def sampled_digest(path):
    """sha256 of a file's size and of SAMPLED_BLOCKS blocks at fixed offsets spread over it, the first at
    its start and the last at its end (a file of at most that many blocks: all of it)."""
    with open(path, 'rb') as f:
        size = os.fstat(f.fileno()).st_size
        digest = hashlib.sha256(f"{size} bytes".encode())
        if size <= SAMPLED_BLOCKS * SAMPLED_BLOCK_BYTES:
            offsets = range(0, size, SAMPLED_BLOCK_BYTES)
        else:
            offsets = [k * (size - SAMPLED_BLOCK_BYTES) // (SAMPLED_BLOCKS - 1) for k in range(SAMPLED_BLOCKS)]
        for offset in offsets:
            f.seek(offset)
            digest.update(f.read(SAMPLED_BLOCK_BYTES))
    return digest.hexdigest()


def dataset_fingerprint(dataset):
    """What tells one prepared dataset from another, kept in ckpt.pt: the size of its train.bin and
    val.bin and a hash of each one's sampled blocks (sampled_digest), so that the same data moved or
    renamed is the same dataset and another one of the same size is not; None where they cannot be read."""
    try:
        folder = dataset_folder(dataset, ROOT)
        fingerprint = {}
        for split in ('train', 'val'):
            path = os.path.join(folder, f'{split}.bin')
            fingerprint[f'{split}_bytes'] = os.path.getsize(path)
            fingerprint[f'{split}_sampled_sha256'] = sampled_digest(path)
        return fingerprint
    except (OSError, TypeError):
        return None


def dataset_difference(checkpoint, dataset):
    """
    None where `dataset` is the one ckpt.pt was trained on, else what tells them apart, for a message
    ('' where only the folders' names do). Compared by what ckpt.pt keeps: its dataset_fingerprint (from
    older versions: the sizes alone, so they are all that is compared), else (older still) the folder's name.
    """
    then = (checkpoint.get('config') or {}).get('dataset')
    saved, now = checkpoint.get('dataset_fingerprint'), dataset_fingerprint(dataset)
    if isinstance(saved, dict) and now is not None:
        for split in ('train', 'val'):
            size = f'{split}_bytes'
            if size in saved and saved[size] != now[size]:
                return f" ({split}.bin of {saved[size]:,} bytes, now {now[size]:,})"
            content = f'{split}_sampled_sha256'
            if content in saved and saved[content] != now[content]:
                return f" ({split}.bin of the same size, other content in the blocks compared)"
        return None
    name = lambda d: os.path.basename(os.path.normpath(str(d)))  # noqa: E731
    return "" if then is not None and name(then) != name(dataset) else None


def check_same_dataset(out_dir, checkpoint, dataset):
    """CheckpointError unless this run's --dataset is the one ckpt.pt was trained on (dataset_difference):
    a checkpoint of the same shapes resumes on another dataset without a word otherwise."""
    what = dataset_difference(checkpoint, dataset)
    if what is not None:
        then = (checkpoint.get('config') or {}).get('dataset')
        raise CheckpointError(f"{out_dir}/ckpt.pt was trained on --dataset={then!r}, this run reads "
                              f"--dataset={dataset!r}{what}; nothing was changed: resume with the dataset it was "
                              f"trained on, or use another out_dir")


def check_out_dir_model(out_dir, checkpoint, data_vocab_size=None):
    """
    CheckpointError unless out_dir/ckpt.pt holds the model that out_dir's config.json and log.csv
    describe, and one that reads the dataset's tokens: another model's checkpoint copied in must
    stop the resume before it cuts the log. config.json names the architecture and the vocabulary
    (one written before it recorded the model built names the flags, which the checkpoint's own
    config holds too); log.csv's GNS columns name the parameters. Another run's checkpoint of the
    same model must stop it too: config.json and the checkpoint's config keep the run's run_id
    (run_identity), and the checkpoint the last row its run had logged (its log_row), which log.csv
    must hold as it was. Files from before either was kept are not compared. Reads, never writes.
    """
    saved, then = checkpoint['model_args'], checkpoint.get('config') or {}
    path = os.path.join(out_dir, 'config.json')
    try:
        with open(path, encoding='utf-8') as f:
            described = json.load(f)
    except FileNotFoundError:
        described = {}
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read ({why(e, 120)}); move it away to resume without it") from None
    for k in ARCHITECTURE_ARGS:
        if isinstance(described, dict) and k in described and k in saved and _plain(described[k]) != _plain(saved[k]) \
                and (k not in then or _plain(described[k]) != _plain(then[k])):
            raise CheckpointError(f"{out_dir}/ckpt.pt holds another model than {path} describes ({k} {saved[k]!r} in "
                                  f"ckpt.pt, {described[k]!r} in config.json); nothing was changed: move one of "
                                  f"them away or use another out_dir")
    ours, described_run = then.get('run_id'), described.get('run_id') if isinstance(described, dict) else None
    if ours and described_run and ours != described_run:
        raise CheckpointError(f"{out_dir}/ckpt.pt is another run's (run_id {ours}) than {path} describes (run_id "
                              f"{described_run}); nothing was changed: move one of them away or use another out_dir")
    if data_vocab_size is not None and data_vocab_size > saved['vocab_size']:
        raise CheckpointError(f"{out_dir}/ckpt.pt's model reads {saved['vocab_size']} tokens, the dataset has "
                              f"{data_vocab_size}: it is another model's checkpoint, or the wrong --dataset")
    try:
        with open(os.path.join(out_dir, 'log.csv'), 'rb') as f:
            header = f.readline(1 << 20).decode('utf-8', 'replace')
    except OSError:
        return
    weights = {_state_dict_key(k) for k in checkpoint['model']}
    logged = re.findall(r'(?:^|,|/)([\w.]+\.(?:weight|bias))/', header)
    alien = [name for name in logged if _state_dict_key(name) not in weights]
    if alien:
        raise CheckpointError(f"{out_dir}/log.csv measures {alien[0]}, which {out_dir}/ckpt.pt's model does not "
                              f"have: the checkpoint is another model's; nothing was changed: move one of them "
                              f"away or use another out_dir")
    kept = checkpoint.get('log_row')
    if isinstance(kept, dict) and isinstance(kept.get('cells'), dict):
        found = logged_row(os.path.join(out_dir, 'log.csv'), kept.get('step'))
        differ = [k for k, cell in kept['cells'].items() if found is not None and found.get(k, '') != cell]
        if differ:
            k = differ[0]
            raise CheckpointError(f"{out_dir}/log.csv's row of step {kept['step']} is not the one {out_dir}/ckpt.pt's "
                                  f"run logged ({k} {found.get(k, '')!r} there, {kept['cells'][k]!r} in ckpt.pt): "
                                  f"they are two runs' files; nothing was changed: move one of them away or use "
                                  f"another out_dir")


def run_identity(checkpoint=None):
    """train.py's run_id (in config.json and ckpt.pt's config): a resumed run's from its checkpoint, a new
    random one for a new run, or for a checkpoint written before runs had one."""
    return ((checkpoint or {}).get('config') or {}).get('run_id') or secrets.token_hex(8)


def model_args_for(config, data_vocab_size=None):
    """train.py's model arguments: its flags named after GPTConfig's fields (n_layer, ..., norm, mlp, ...),
    and the dataset's vocabulary size, else GPT-2's 50257 padded to 50304."""
    model_args = {f.name: config[f.name] for f in fields(GPTConfig) if f.name in config}
    model_args['vocab_size'] = data_vocab_size or 50304
    return model_args


def init_model(init_from, model_args, config, out_dir, device='cpu', data_vocab_size=None, places=None):
    """
    train.py's model and the checkpoint it resumes (None unless init_from='resume'): a new GPT of
    model_args ('scratch'), the one in out_dir/ckpt.pt ('resume', see resume_model) or OpenAI's
    GPT-2 weights ('gpt2*'), cropped to the run's block_size. model_args is updated in place with
    the architecture built. A resume first compares the run's flags with the checkpoint's model
    (places: where each key was set, see check_resume_flags), and checks that the checkpoint is out_dir's
    model and run (check_out_dir_model; data_vocab_size: the dataset's vocabulary, if it says).
    Build it inside the layer config the run measures with. Raises CheckpointError, one line.
    """
    checkpoint = None
    if init_from == 'scratch':
        print("Initializing a new model from scratch")
        model = GPT(GPTConfig(**model_args))
    elif init_from == 'resume':
        print(f"Resuming training from {out_dir}")
        model, checkpoint = resume_model(os.path.join(out_dir, 'ckpt.pt'), model_args, config, device, places)
        check_out_dir_model(out_dir, checkpoint, data_vocab_size)
        if 'dataset' in config:
            check_same_dataset(out_dir, checkpoint, config['dataset'])
    else:
        print(f"Initializing from OpenAI GPT-2 weights: {init_from}")
        model = pretrained_gpt(init_from, model_args['dropout'])
        model_args.update({k: getattr(model.config, k) for k in ARCHITECTURE_ARGS})
    if config['block_size'] < model.config.block_size:
        model.crop_block_size(config['block_size'])
        model_args['block_size'] = config['block_size']
    return model, checkpoint


# -- the random states a run depends on, so that a resumed run continues as the uninterrupted one
# would: the train batches' order is one generator, drawn alike on every rank and saved in ckpt.pt;
# dropout (torch's global RNG, different on every rank: rank 0 could not save the others') and the
# evaluation batches are seeded from the step, so a step draws the same whenever it runs.

def data_order(seed, checkpoint=None):
    """The generator of the train batches' order: a new run's from `seed`, a resumed run's where
    ckpt.pt left it. A checkpoint written before the order was saved restarts it (said in one line)."""
    rng = torch.Generator()
    if checkpoint is not None and 'data_order' in checkpoint:
        return rng.set_state(checkpoint['data_order'])
    iter_num = int(checkpoint.get('iter_num', 0)) if checkpoint is not None else 0
    if checkpoint is not None:
        print(f"note: ckpt.pt holds no data order (it predates them): the train batches' order restarts "
              f"at iter {iter_num}, so the run does not continue as the interrupted one would have")
    return rng.manual_seed(seed * 1_000_003 + iter_num)


def step_seed(seed, rank, iter_num):
    """The seed of torch's global RNG (dropout) for the step iter_num on a rank: a stream of its own,
    apart from the data order's and the evaluations' seeds."""
    return ((seed * 1_000_003 + iter_num) * 4 + 3) * 4096 + rank


def eval_generator(seed, iter_num, split):
    """The generator of the evaluation batches at iter_num: the same batches whenever that evaluation runs."""
    return torch.Generator().manual_seed((seed * 1_000_003 + iter_num) * 4 + 1 + ('train', 'val').index(split))


def training_run_state(scaler, model_args, config, iter_num, best_val_loss, nonfinite_steps, data_order_state,
                       estimators, controller=None, last_row=None):
    """
    What ckpt.pt holds beside the model's and the optimizer's state (save_training_state's run_state),
    read back on resume: the scaler's state (load_optimizer_state), the architecture and the config
    (resume_model), the counts (resumed_counts), the train batches' order (data_order), the GNS
    estimators' states (gnstracking.load_states) and the batch-size controller's, if the run has one
    (schedules.controller_for_run); last_row, the log's last row (LogWrapper.last_row), for
    check_out_dir_model.
    """
    import nanogns.estimators.exact as gnstracking  # here: sample.py reads checkpoints without the estimators
    run_state = {'scaler': scaler.state_dict(), 'model_args': model_args, 'iter_num': iter_num,
                 'best_val_loss': best_val_loss, 'config': config, 'data_order': data_order_state,
                 'nonfinite_steps': nonfinite_steps, 'dataset_fingerprint': dataset_fingerprint(config.get('dataset'))}
    gnstracking.save_states(estimators, run_state)
    if controller is not None:
        run_state['bs_controller'] = controller.state_dict()
    if last_row is not None:
        run_state['log_row'] = {'step': last_row[0], 'cells': last_row[1]}
    return run_state


def resumed_counts(checkpoint):
    """(iter_num, best_val_loss, nonfinite_steps) a run starts from: a resumed run's checkpoint's
    (nanoGPT's and the reference's count no non-finite steps), or a new run's (no checkpoint)."""
    if not checkpoint:
        return 0, 1e9, 0
    return (int(checkpoint.get('iter_num', 0)), float(checkpoint.get('best_val_loss', 1e9)),
            int(checkpoint.get('nonfinite_steps', 0)))


def save_training_state(path, model, optimizer, run_state, fsdp=False, writer=True):
    """
    Write `path` (write_checkpoint) with the model's and optimizer's state and run_state (the
    scaler, the iteration, the config, the estimators' ...). Returns True when written, False when
    not: the weights are not finite (a diverged run must not replace a good checkpoint), or this
    process is not the `writer`. FSDP: a collective, the full state gathered onto the writer's CPU.
    Raises CheckpointError when the write fails (a full disk).
    """
    model_state, optim_state = (gather_fsdp_state(model, optimizer) if fsdp else
                                (model.state_dict(), optimizer.state_dict()))
    if not writer:
        return False
    weights = [v for v in model_state.values() if v.is_floating_point()]
    if not torch.stack([torch.isfinite(v).all() for v in weights]).all():
        return False
    print(f"saving checkpoint to {os.path.dirname(path)}")
    write_checkpoint({'model': model_state, 'optimizer': optim_state, **run_state}, path)
    return True



# FSDP2: ckpt.pt in the single-process format, gathered from and scattered to the shards

def _fsdp_state_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def _optimizer_fqns(model, optimizer):
    """The parameters' names in optimizer.state_dict()'s order: its integer ids index this list."""
    names = {}
    for name, p in model.named_parameters():  # a tied parameter once, under its first name
        names.setdefault(id(p), name)
    return [names[id(p)] for group in optimizer.param_groups for p in group['params']]


def gather_fsdp_state(model, optimizer):
    """
    (model state, optimizer state) of a sharded model, gathered in full onto rank 0's CPU, in the
    format a single process writes (model.state_dict(), optimizer.state_dict() keyed by integer
    ids), so ckpt.pt loads anywhere; ({}, {}) on the other ranks. A collective: call on every rank.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    model_state = get_model_state_dict(model, options=_fsdp_state_options())
    named = get_optimizer_state_dict(model, optimizer, options=_fsdp_state_options())
    if not model_state:
        return {}, {}
    index = {name: i for i, name in enumerate(_optimizer_fqns(model, optimizer))}
    optim_state = {'state': {index[name]: state for name, state in named['state'].items()},
                   'param_groups': [{**g, 'params': [index[name] for name in g['params']]}
                                    for g in named['param_groups']]}
    return model_state, optim_state


def _load_fsdp_optimizer_state(saved, model, optimizer):
    """load_optimizer_state()'s FSDP part: the saved full state (integer ids) sharded onto this rank."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
    fqns = _optimizer_fqns(model, optimizer)
    named = {'state': {fqns[i]: state for i, state in saved['state'].items()},
             'param_groups': [{**g, 'params': [fqns[i] for i in g['params']]} for g in saved['param_groups']]}
    set_optimizer_state_dict(model, optimizer, named, options=_fsdp_state_options())
