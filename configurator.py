"""
nanoGPT's "poor man's configurator": configuration is plain Python globals.

    python train.py config/train_shakespeare_char.py --batch_size=32 --compile=False

Each positional argument is a Python file executed over the defaults; each --key=value
overrides one existing key, with the value parsed as a Python literal (falling back to a
string) and checked against the default's type (values a config file sets are checked too).
A config file sees its own path as __file__, so that it can build on another one beside it:
`exec(open(os.path.join(os.path.dirname(__file__), 'base.py')).read())`, then its changes.
Bad input raises ConfigError, which train.py turns into one line on stderr and exit code 2.

Scripts written for nanoGPT (or the reference implementation) apply it their way,
`exec(open('configurator.py').read())` among their globals, and that works here as well.
"""
import math
import os
import pickle
import stat
import sys
import time
import warnings
import tokenize
from ast import literal_eval


class ConfigError(Exception):
    pass


def die(message):
    """Bad input, for every tool here: one line on stderr and exit code 2, never a traceback. Under
    torchrun every process checks the same values: the first process of each node says it, once."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"error: {message}", file=sys.stderr)
    else:  # torchrun stops every process once one exits: the others leave after the first has said it
        time.sleep(FIRST_SAYS_IT_SECONDS)
    sys.exit(2)


FIRST_SAYS_IT_SECONDS = 5  # a bound on how far behind its peers the first process may reach the same check


def check_number(config, key, low, high=math.inf, whole=False, low_ok=True):
    """die() unless config[key] is a (whole) number in [low, high), or (low, high) if not low_ok."""
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)) \
            or not (value >= low if low_ok else value > low) or not value < high:
        bounds = f"{'>=' if low_ok else '>'} {low}" + (f" and < {high}" if high < math.inf else "")
        die(f"--{key}={value!r} must be a {'whole ' if whole else ''}number {bounds}")


def check_device(device):
    """The device's type ('cpu', 'cuda' or 'mps') if this machine has it, else die()."""
    import torch  # here: exec'd into a script, this file imports nothing heavy
    try:
        kind, index = torch.device(device).type, torch.device(device).index
    except (RuntimeError, ValueError):
        kind = index = None
    if kind not in ('cpu', 'cuda', 'mps'):
        die(f"--device={device!r} is not a device: use cpu, cuda, cuda:N or mps")
    if kind == 'cuda' and not torch.cuda.is_available():
        die(f"--device={device} but CUDA is not available here; use --device=cpu")
    if kind == 'cuda' and (index or 0) >= torch.cuda.device_count():
        die(f"--device={device} but this machine has {torch.cuda.device_count()} CUDA device(s)")
    if kind == 'mps' and not torch.backends.mps.is_available():
        die(f"--device={device} but MPS is not available here; use --device=cpu")
    return kind


def dataset_folder(dataset, root):
    """The folder --dataset names: a path to one, or a name under root/data/."""
    return dataset if os.path.isdir(dataset) or os.sep in dataset else os.path.join(root, 'data', dataset)


def check_dataset(dataset, root):
    """The folder of --dataset (dataset_folder) if it holds train.bin and val.bin, else die() saying
    how to prepare it: its prepare.py where there is one, else which datasets data/ has."""
    if not isinstance(dataset, str) or not dataset.strip():
        die(f"--dataset={dataset!r} must name a folder under data/ or a path to one")
    data_dir = dataset_folder(dataset, root)
    is_path = data_dir == dataset
    for split in ('train', 'val'):
        if not os.path.exists(os.path.join(data_dir, f'{split}.bin')):
            missing = f"dataset {dataset!r} is not prepared ({os.path.join(data_dir, split + '.bin')} is missing)"
            if is_path:
                die(f"{missing}; a dataset folder holds train.bin and val.bin, as data/<name>/prepare.py writes them")
            if os.path.isfile(os.path.join(data_dir, 'prepare.py')):
                die(f"{missing}; run: python data/{dataset}/prepare.py")
            die(f"{missing} and there is no data/{dataset}/prepare.py; {datasets_under(root)}")
    return data_dir


def datasets_under(root):
    """Which datasets root/data/ has, in one clause: those prepared, and those its prepare.py scripts make."""
    prepared, preparable = [], []
    try:
        names = sorted(os.listdir(os.path.join(root, 'data')))
    except OSError:
        names = []
    for name in names:
        folder = os.path.join(root, 'data', name)
        if all(os.path.isfile(os.path.join(folder, f'{split}.bin')) for split in ('train', 'val')):
            prepared.append(name)
        elif os.path.isfile(os.path.join(folder, 'prepare.py')):
            preparable.append(name)
    return (f"prepared datasets: {', '.join(prepared) or 'none'}" +
            (f"; not yet prepared: {', '.join(preparable)} (run python data/<name>/prepare.py)" if preparable else ""))


MAX_META_BYTES = 64 << 20  # a character vocabulary's meta.pkl is a few KB


def read_meta(meta_path):
    """A dataset's meta.pkl, unpickled: a regular file (a FIFO would block, a device never end) of at
    most MAX_META_BYTES, checked before it is opened. Raises OSError, ValueError or unpickling's errors."""
    st = os.stat(meta_path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError("not a regular file")
    if st.st_size > MAX_META_BYTES:
        raise ValueError(f"larger than {MAX_META_BYTES:,} bytes")
    with open(meta_path, 'rb') as f:
        return pickle.loads(f.read(MAX_META_BYTES + 1))


def dataset_vocab_size(data_dir, quiet=False):
    """The vocabulary size a dataset folder's meta.pkl names (character-level datasets write one),
    else None: the dataset is GPT-2's BPE."""
    meta_path = os.path.join(data_dir, 'meta.pkl')
    if not os.path.exists(meta_path):
        return None
    vocab_size = read_meta(meta_path)['vocab_size']
    if not quiet:
        print(f"found vocab_size = {vocab_size} (inside {meta_path})")
    return vocab_size


def host_memory():
    """Bytes this process may still allocate on the host, or None if nothing says: the available
    memory (Linux's MemAvailable and free swap, else os.sysconf's pages), lowered by an address-space
    limit (ulimit -v, less what is mapped already) and by a cgroup's memory limit."""
    def read_ints(path):
        with open(path) as f:
            return f.read(1 << 16).split()
    page = os.sysconf('SC_PAGE_SIZE') if hasattr(os, 'sysconf') else 4096
    bounds = []
    try:
        with open('/proc/meminfo') as f:
            info = dict(line.split(':', 1) for line in f.read(1 << 16).splitlines() if ':' in line)
        bounds.append((int(info['MemAvailable'].split()[0]) + int(info.get('SwapFree', '0 kB').split()[0])) * 1024)
    except (OSError, KeyError, ValueError, IndexError):
        for name in ('SC_AVPHYS_PAGES', 'SC_PHYS_PAGES'):  # macOS has only the second
            try:
                bounds.append(os.sysconf(name) * page)
                break
            except (AttributeError, ValueError, OSError):
                pass
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            try:  # every mapping counts against this limit, the libraries' included
                mapped = int(read_ints('/proc/self/statm')[0]) * page
            except (OSError, ValueError, IndexError):
                mapped = 0
            bounds.append(soft - mapped)
    except (ImportError, OSError, ValueError):
        pass
    for path in ('/sys/fs/cgroup/memory.max', '/sys/fs/cgroup/memory/memory.limit_in_bytes'):  # cgroup v2, v1
        try:
            bounds.append(int(read_ints(path)[0]))
            break
        except (OSError, ValueError, IndexError):  # none, or 'max'
            pass
    return max(0, min(bounds)) if bounds else None


def available_memory(device_type, index=None):
    """Bytes free where the model lives: a CUDA device's (torch.cuda.mem_get_info), else the host's
    (host_memory). None where it cannot be told."""
    if device_type != 'cuda':
        return host_memory()
    import torch
    try:
        return torch.cuda.mem_get_info(index)[0]
    except RuntimeError:
        return None


GPT2_SIZES = {'gpt2': (12, 768), 'gpt2-medium': (24, 1024), 'gpt2-large': (36, 1280), 'gpt2-xl': (48, 1600)}


def model_size(config, vocab_size):
    """
    (flags, parameters, activations, vocabulary) of the GPT train.py builds, at least: its matrices'
    parameters (the biases and gains are few), and the activations a token keeps for the backward
    pass (each block's Q, K, V and its MLP's hidden layer; torch.compile may recompute the rest), with
    the flags that make it. A resumed run's model is the checkpoint's: its file holds the weights and
    AdamW's two moments, 12 bytes a parameter (its activations are not counted). None where nothing says.
    """
    init_from = config['init_from']
    if init_from == 'resume':
        ckpt = os.path.join(config['out_dir'], 'ckpt.pt')
        return (f"--init_from=resume ({ckpt})", os.path.getsize(ckpt) // 12, 0, vocab_size) if os.path.isfile(ckpt) \
            else None
    from model import swiglu_hidden
    if init_from in GPT2_SIZES:
        (n_layer, n_embd), vocab_size, flags = GPT2_SIZES[init_from], 50257, f"--init_from={init_from}"
        mlp, pos_emb, tie = 'gelu', 'learned', True
    else:
        n_layer, n_embd = config['n_layer'], config['n_embd']
        flags, mlp, pos_emb, tie = (f"--n_layer={n_layer} --n_embd={n_embd}", config['mlp'], config['pos_emb'],
                                    config['tie_embeddings'])
    hidden, matrices = (swiglu_hidden(n_embd), 3) if mlp == 'swiglu' else (4 * n_embd, 2)
    block = 4 * n_embd * n_embd + matrices * n_embd * hidden
    embeddings = vocab_size * n_embd * (1 if tie else 2) + (config['block_size'] * n_embd if pos_emb == 'learned' else 0)
    return flags, n_layer * block + embeddings, n_layer * (3 * n_embd + (matrices - 1) * hidden), vocab_size


def check_memory(config, device_type, vocab_size):
    """
    die() where the model, or the model and one micro-batch, clearly cannot fit: the parameters with
    their gradients and AdamW's two moments (16 bytes each, float32; 4 with --eval_only; a CUDA run
    builds the model on the host first, 4 bytes each there), and a micro-batch's inputs and targets
    (int64), activations (model_size's; none with --eval_only) and logits (4 bytes each, 2 under
    autocast). A lower bound, so that what it refuses could never run, instead of failing in an
    allocation (a traceback, or the kernel's OOM killer), swapping for hours, or building its batch
    for ever.
    """
    flags, params, activations, vocab_size = model_size(config, vocab_size or 50304) or ('', 0, 0, vocab_size or 50304)
    training = not config.get('eval_only')
    tokens = config['batch_size'] * config['block_size']
    token_bytes = 16 + (activations * training + vocab_size) * (4 if config['dtype'] == 'float32' else 2)
    gib = lambda n: f"{n / 2**30:,.1f} GiB"  # noqa: E731
    state = ("weights, gradients and AdamW state", 16) if training else ("weights", 4)
    batch = ("tokens, activations and logits" if training else "tokens and logits", token_bytes)
    # (bytes free, where, what the model needs there and bytes a parameter, what a batch does and bytes a token)
    if device_type != 'cuda':
        memories = [(host_memory(), "of memory this machine has available", state, batch)]
    else:  # the model is built on the host first
        import torch
        index = torch.device(config['device']).index
        if 'RANK' in os.environ:  # torchrun: each process its own device, its shard under FSDP
            index = int(os.environ.get('LOCAL_RANK', 0))
        shards = int(os.environ.get('WORLD_SIZE', 1)) if config.get('fsdp') else 1
        memories = [(host_memory(), "of memory this machine has available", ("weights", 4), ("tokens", 16)),
                    (available_memory('cuda', index), f"free on cuda:{index or 0}",
                     (state[0] + (" (its shard)" if shards > 1 else ""), state[1] / shards), batch)]
    for free, where, (model_needs, per_param), (batch_needs, per_token) in memories:
        if free is None:
            continue
        if params * per_param > free:
            die(f"{flags}: a model of {params:,} parameters needs {gib(params * per_param)} for its {model_needs}, "
                f"more than the {gib(free)} {where}")
        if params * per_param + tokens * per_token > free:
            die(f"--batch_size={config['batch_size']} --block_size={config['block_size']}: one micro-batch's "
                f"{batch_needs} need {gib(tokens * per_token)}, more than the "
                f"{gib(max(0, free - params * per_param))} {where} beside the model")


def check_resources(config, root):
    """
    train.py's device, data and memory, checked before anything is built: (device type, data folder),
    or die() in one line. The data must give a block (block_size + 1 tokens) from each split, and
    the model and a micro-batch must fit in memory (check_memory).
    """
    device_type = check_device(config['device'])
    data_dir = check_dataset(config['dataset'], root)
    for split in ('train', 'val'):
        tokens = os.path.getsize(os.path.join(data_dir, f'{split}.bin')) // 2  # uint16 tokens
        if tokens <= config['block_size']:
            die(f"--block_size={config['block_size']} is more than the data can give: {split}.bin holds "
                f"{tokens:,} tokens, and a block takes block_size + 1 of them")
    try:
        vocab_size = dataset_vocab_size(data_dir, quiet=True)
    except Exception as e:  # damaged: pickle raises many kinds
        die(f"{os.path.join(data_dir, 'meta.pkl')} cannot be read ({type(e).__name__}: {e})")
    check_memory(config, device_type, vocab_size)
    return device_type, data_dir


def check_train_config(config, places=None):
    """
    train.py's values, all checked before anything runs (die() at the first bad one), then its
    lengths made tokens: a length given in nanoGPT's iterations counts tokens of the configured
    step; unset, they are nanoGPT's 600000 iterations of training and of decay, 2000 of warmup.
    A length set in one unit by a later place (configure()'s `places`: a file, or the command line)
    replaces the other unit's setting by an earlier place, as any later setting does in nanoGPT;
    both units from one place is an error.
    """
    places = places or {}
    from nanogns.layers import PER_EXAMPLE_MODES
    from nanogns.layers.config import FLAG_CLASSES  # here: imports torch
    from nanogns.schedules import LR_DECAY_SHAPES
    choices = {**{flag: tuple(values) for flag, values in FLAG_CLASSES.items()},
               'gns_hooks': ('none', 'sogns', 'exact'), 'dtype': ('float32', 'bfloat16', 'float16'),
               'lr_decay_shape': LR_DECAY_SHAPES, 'per_example_mode': PER_EXAMPLE_MODES}
    for key, allowed in choices.items():
        if config[key] not in allowed:
            die(f"--{key}={config[key]!r} is not one of {', '.join(allowed)}")
    init_from = config['init_from']
    if init_from not in ('scratch', 'resume', 'gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl'):
        die(f"--init_from={init_from!r} is not one of scratch, resume, gpt2, gpt2-medium, gpt2-large, gpt2-xl")
    for key in ('batch_size', 'block_size', 'n_layer', 'n_head', 'n_embd', 'gradient_accumulation_steps',
                'eval_interval', 'log_interval', 'eval_iters', 'max_nonfinite_steps'):
        check_number(config, key, 1, whole=True)
    if config['n_embd'] % config['n_head']:
        die(f"--n_embd={config['n_embd']} must be a multiple of --n_head={config['n_head']}")
    from model import architecture_error  # the model's own check of --norm, --mlp, --pos_emb, --tie_embeddings
    error = architecture_error(config)
    if error:
        die(f"--{error}")
    for key, low, high in (('dropout', 0, 1), ('beta1', 0, 1), ('beta2', 0, 1), ('min_lr', 0, math.inf),
                           ('weight_decay', 0, math.inf), ('grad_clip', 0, math.inf)):
        check_number(config, key, low, high)
    check_number(config, 'learning_rate', 0, low_ok=False)
    if config['decay_lr'] and config['min_lr'] > config['learning_rate']:
        die(f"--min_lr={config['min_lr']!r} is above --learning_rate={config['learning_rate']!r}: the rate would "
            f"grow as it 'decays' (set --min_lr at most --learning_rate, or --decay_lr=False)")
    n_layer = config['n_layer']
    for key in ('cos_attn', 'spectral_c_attn', 'fp32_attention_layers'):
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_layer for i in config[key]):
            die(f"--{key}={config[key]!r} must list block indices 0..{n_layer - 1}")
    world_size = int(os.environ.get('WORLD_SIZE', 1)) if 'RANK' in os.environ else 1  # torchrun's
    if config.get('fsdp') and 'RANK' not in os.environ:
        die("--fsdp=True shards the model over processes: launch with torchrun, "
            "e.g. torchrun --standalone --nproc_per_node=2 train.py ... --fsdp=True")
    if config.get('fsdp') and (config['gns_hooks'] != 'none' or config['microbatch_gns']):
        die("--fsdp=True measures with the per-example-norm layers alone: --gns_hooks and --microbatch_gns "
            "read whole, unsharded gradients (run them under DDP)")
    if config['gns_hooks'] != 'none' and config['compile']:
        print("note: with --gns_hooks the compiled model runs its forward eagerly (dynamo cannot trace the hooks)")
    gas = config['gradient_accumulation_steps']
    if gas % world_size and not config['bs_schedule']:
        die(f"gradient_accumulation_steps={gas} is not divisible by the {world_size} DDP processes (it counts "
            f"micro-steps over all processes: use --gradient_accumulation_steps={world_size} or a multiple)")
    if config['bs_controller'] not in ('none', 'gns'):
        die(f"--bs_controller={config['bs_controller']!r} is not one of none, gns")
    if config['bs_schedule_points'] and not config['bs_schedule']:
        print("warning: --bs_schedule_points is unused without --bs_schedule=True", file=sys.stderr)
    if config['bs_controller'] == 'gns' and config['bs_schedule']:
        die("--bs_controller=gns and --bs_schedule=True both set the batch size; choose one")
    if config['bs_gns_group'] not in (None, 'total', 'LayerNorm', 'adam'):
        die(f"--bs_gns_group={config['bs_gns_group']!r} is not one of total, LayerNorm, adam (or None: the group measured)")
    if config['gns_adam'] and config['lnclass'] != 'shim':
        die(f"--gns_adam=True measures the separated normalisation layers' per-coordinate sums: use --lnclass=shim "
            f"(not {config['lnclass']})")
    if config['gns_adam'] and config.get('fsdp'):
        die("--gns_adam=True needs each parameter's whole optimizer state on every rank: run it under DDP, not FSDP")
    if config['bs_gns_group'] == 'adam' and not config['gns_adam']:
        die("--bs_gns_group=adam follows the Adam-preconditioned GNS: add --gns_adam=True")
    check_number(config, 'bs_gns_fraction', 0, low_ok=False)
    check_number(config, 'bs_min_accum', 1, whole=True)
    if config['bs_min_accum'] > gas:
        die(f"--bs_min_accum={config['bs_min_accum']} is above --gradient_accumulation_steps={gas}, "
            f"the batch-size controller's ceiling")
    check_number(config, 'bs_warmup_steps', 0, whole=True)
    if config['bs_update_tokens'] is not None:
        check_number(config, 'bs_update_tokens', 0, whole=True)
    if config['bs_controller'] == 'gns' and config['bs_min_accum'] % world_size:
        die(f"--bs_min_accum={config['bs_min_accum']} is not divisible by the {world_size} DDP processes "
            f"(it counts global micro-steps, as gradient_accumulation_steps does)")
    out_dir = config['out_dir']
    if not out_dir or (os.path.exists(out_dir) and not os.path.isdir(out_dir)):
        die(f"--out_dir={out_dir!r} must name a directory")
    from nanogns.runlog import directory_problem
    problem = directory_problem(out_dir)  # a dangling symbolic link on the way, say
    if problem:
        die(f"--out_dir={out_dir!r} cannot be made: {problem}")
    tokens_per_iter = config['gradient_accumulation_steps'] * config['batch_size'] * config['block_size']
    for key, default_iters in (('max', 600000), ('warmup', 2000), ('lr_decay', 600000)):
        tokens, iters = config[f'{key}_tokens'], config[f'{key}_iters']
        for given in (f'{key}_tokens', f'{key}_iters'):
            if config[given] is not None:
                check_number(config, given, 1 if key == 'max' else 0, whole=given.endswith('iters'))
        if tokens is not None and iters is not None:
            (where_t, at_t), (where_i, at_i) = (places.get(f'{key}_{unit}', ('the defaults', -1))
                                                for unit in ('tokens', 'iters'))
            if where_t == where_i:
                die(f"--{key}_tokens and --{key}_iters set the same length twice ({where_t}); set one of them")
            replaced, by, where = (f'{key}_tokens', f'{key}_iters', where_i) if at_i > at_t \
                else (f'{key}_iters', f'{key}_tokens', where_t)
            print(f"note: {by}={config[by]!r} from {where} replaces {replaced}={config[replaced]!r}")
            config[replaced] = None
            tokens, iters = config[f'{key}_tokens'], config[f'{key}_iters']
        if tokens is None:
            config[f'{key}_tokens'] = (iters if iters is not None else default_iters) * tokens_per_iter
    points = config['bs_schedule_points']
    if points:  # what out_dir/grad_accum_schedule.txt would be written from, checked as it would be read
        from nanogns.schedules import max_accumulation_steps
        bound = max_accumulation_steps(config['max_tokens'], config['batch_size'], config['block_size'], world_size)
        shown = repr(points) if len(repr(points)) <= 80 else repr(points)[:77] + '...'
        for point in points:
            numbers = isinstance(point, (list, tuple)) and len(point) == 2 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < 1e300 for v in point)  # nan too
            if not numbers or point[0] < 0 or point[1] <= 0:
                die(f"--bs_schedule_points={shown}: each point is (tokens >= 0, global accumulation steps > 0), "
                    f"not {point!r}")
            if point[1] > bound and config['bs_schedule']:  # (unused, it is merely warned about above)
                die(f"--bs_schedule_points={shown}: {point[1]!r} accumulation steps is over the bound of {bound:_} "
                    f"for --max_tokens={config['max_tokens']:_} (see schedules.max_accumulation_steps)")


def configure_train(argv, config, doc=""):
    """train.py's command line applied to its defaults `config` (configure()), then every value
    checked (check_train_config()) before anything runs: bad input is one line and exit code 2,
    and from here on every warning (a resumed log's missing rows, a schedule edit refused) is one
    line too. Where each key was set goes along, so that a later place's length replaces an
    earlier one's other unit; it is returned ({key: (where, position)}, configure()'s places), for
    a resume's check of the architecture flags set against the checkpoint's."""
    warnings.formatwarning = lambda message, *args, **kwargs: f"warning: {message}\n"
    places = {}
    try:
        configure(argv, config, doc, places)
    except ConfigError as e:
        die(str(e))
    check_train_config(config, places)
    return places


def _checked(key, value, default, shown):
    """value if it fits the default's type (an int where a float is expected becomes a float),
    else ConfigError; a default of None takes anything (train.py checks those itself)."""
    if default is None:
        return value
    if isinstance(default, bool) or isinstance(value, bool):
        if isinstance(default, bool) and isinstance(value, bool):
            return value
        expected = "bool (True/False)" if isinstance(default, bool) else f"{type(default).__name__} (default {default!r})"
        raise ConfigError(f"{key} expects {expected}, got {shown}")
    if isinstance(default, float) and isinstance(value, int):
        return float(value)  # --learning_rate=1 means 1.0
    if isinstance(default, (list, tuple)) and isinstance(value, (list, tuple)):
        return type(default)(value)
    if not isinstance(value, type(default)):
        raise ConfigError(f"{key} expects {type(default).__name__} (default {default!r}), got {shown}")
    return value


def _coerce(key, value, default):
    """Parse a --key=value string and check it against the default's type."""
    try:
        parsed = literal_eval(value)
    except (SyntaxError, ValueError):
        parsed = value  # a bare word is a string: --dataset=openwebtext
    return _checked(f"--{key}", parsed, default, repr(value))


def key_comments(path):
    """From the script at path, for each top-level `key = value  # comment` line: the comment, and the
    comment lines standing right above it (a group's heading). --help shows both beside the keys:
    the script's defaults are their own documentation. Returns {key: (heading lines, comment)}."""
    keys, comments, heading = {}, {}, []
    try:
        with open(path) as f:
            for token in tokenize.generate_tokens(f.readline):
                if token.type == tokenize.COMMENT and token.start[1] == 0:
                    heading.append(token.string)
                elif token.type == tokenize.COMMENT:
                    comments[token.start[0]] = token.string.lstrip("#").strip()
                elif token.type == tokenize.NAME and token.start[1] == 0:
                    keys[token.start[0]] = (token.string, heading)
                    heading = []
                elif token.type not in (tokenize.NL, tokenize.NEWLINE) and token.start[1] == 0:
                    heading = []
    except (OSError, SyntaxError, tokenize.TokenError):
        return {}
    return {name: (above, comments.get(row, "")) for row, (name, above) in keys.items()}


def help_text(config, doc=""):
    script = sys.argv[0] if sys.argv and sys.argv[0] else "train.py"
    lines = [doc.strip(), "", f"usage: python {os.path.basename(script)} [config/file.py ...] [--key=value ...]", "",
             "keys and defaults:"]
    comments = key_comments(script)
    width = min(40, max((len(f"--{k}={v!r}") for k, v in config.items()), default=0))
    for k, v in config.items():
        heading, comment = comments.get(k, ((), ""))
        lines += [f"  {line}" for line in heading if not line.startswith("# ---")]
        lines.append(f"  --{k}={v!r}".ljust(width + 2) + f"  {comment}")
    return "\n".join(line.rstrip() for line in lines)


def configure(argv, config, doc="", places=None):
    """Apply config files and --key=value overrides in argv to the dict `config`, in place.
    Only keys already in `config` may be set. Returns the list of what was applied. If given, the
    dict `places` gets, for each key set, (where: the file or 'the command line', position in argv)
    of its last setting: check_train_config lets a later place's length replace an earlier one's."""
    applied = []
    places = {} if places is None else places
    for position, arg in enumerate(argv):
        if arg in ("-h", "--help"):
            try:
                print(help_text(config, doc), flush=True)
            except BrokenPipeError:  # --help | head: the reader has seen enough
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise SystemExit(0)
        if not arg.startswith("--"):
            if "=" in arg and not os.path.isfile(arg) and arg.lstrip("-").split("=", 1)[0] in config:
                raise ConfigError(f"{arg!r} is not a config file; did you mean --{arg.lstrip('-')}?")
            if not os.path.isfile(arg):
                raise ConfigError(f"config file {arg!r} not found")
            print(f"Overriding config with {arg}:")
            with open(arg) as f:
                source = f.read()
            print(source)
            scope = dict(config, __file__=os.path.abspath(arg))
            try:
                exec(compile(source, arg, "exec"), scope)
            except Exception as e:
                raise ConfigError(f"error in config file {arg}: {type(e).__name__}: {e}")
            for key, value in scope.items():
                if key.startswith("_") or key not in config and not _is_plain(value):
                    continue
                if key not in config:
                    raise ConfigError(f"config file {arg} sets unknown key {key!r}")
                if value is not config[key]:
                    config[key] = _checked(f"{key} (set in {arg})", value, config[key], repr(value)[:80])
                    places[key] = (arg, position)
            applied.append(arg)
        else:
            if "=" not in arg:
                raise ConfigError(f"expected --key=value, got {arg!r}")
            key, value = arg[2:].split("=", 1)
            if key not in config:
                close = [k for k in config if key.split("_")[0] in k][:5]
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise ConfigError(f"unknown config key {key!r}{hint}; see --help")
            config[key] = _coerce(key, value, config[key])
            places[key] = ("the command line", position)
            print(f"Overriding: {key} = {config[key]!r}")
            applied.append(arg)
    return applied


def _is_plain(value):
    """Values a config file may set: data, not modules, functions or classes it imported."""
    return isinstance(value, (bool, int, float, str, list, tuple, dict, type(None)))


def apply_to_script(scope):
    """
    nanoGPT's scripts (and the reference implementation's) run this file inside their own globals,
    `exec(open('configurator.py').read())`, to apply the command line to them. This does the same
    with this module's checks: every plain global of the script (not starting with '_') is a key;
    bad input prints one line and exits with code 2.
    """
    config = {k: v for k, v in scope.items() if not k.startswith("_") and _is_plain(v)}
    try:
        configure(sys.argv[1:], config, scope.get("__doc__") or "")
    except ConfigError as e:
        die(str(e))
    scope.update(config)


if __name__ != "configurator":  # exec'd by a script rather than imported
    apply_to_script(globals())
