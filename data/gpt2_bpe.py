"""
GPT-2's byte-pair encoding (tiktoken's "gpt2") where the network may reach only the package index.

tiktoken.get_encoding("gpt2") downloads its BPE files on first use, or reads them from
TIKTOKEN_CACHE_DIR. Where it cannot, GPT-2's ranks come from the openai-whisper sdist on PyPI:
its whisper/assets/gpt2.tiktoken is, byte for byte, tiktoken's r50k_base.tiktoken (GPT-2's
50,256 merge ranks). The file is checked (its sha256, then GPT-2's ids of a few strings) and
cached in data/.cache/, so that reruns are offline.

    sys.path.insert(0, "data")
    from gpt2_bpe import gpt2_encoding
    enc, source = gpt2_encoding()   # a tiktoken.Encoding, and a line saying where it came from
"""
import base64
import hashlib
import os
import subprocess
import tarfile
import tempfile

from fetch import atomic_write, pip_download_sdist

WHISPER_REQUIREMENT = "openai-whisper==20250625"
WHISPER_SDIST = "openai_whisper-20250625.tar.gz"
WHISPER_RANKS = "openai_whisper-20250625/whisper/assets/gpt2.tiktoken"
# sha256 of tiktoken's r50k_base.tiktoken, which tiktoken_ext/openai_public.py checks downloads against
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# GPT-2's own ids (the tokenizer OpenAI released), which the fallback must reproduce
GPT2_KNOWN_IDS = {
    "Hello world": [15496, 995],
    "First Citizen:\n the": [5962, 22307, 25, 198, 262],
    "<|endoftext|>": [50256],
}
CACHE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".cache")


class GPT2EncodingError(Exception):
    """GPT-2's BPE cannot be had from either source; the message is one line for the user."""


def first_line(error, limit=200):
    """An exception as `Type: first line of its message`, cut to fit a one-line error."""
    lines = str(error).strip().splitlines()
    line = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return line if len(line) <= limit else line[:limit - 3] + "..."


def fetch_gpt2_ranks(path):
    """Extract whisper's gpt2.tiktoken from its sdist (pip download) to path, if it is GPT-2's."""
    with tempfile.TemporaryDirectory() as download_dir:
        sdist = pip_download_sdist(download_dir, WHISPER_REQUIREMENT, WHISPER_SDIST)
        with tarfile.open(sdist, "r:gz") as tar:
            ranks = tar.extractfile(WHISPER_RANKS).read()
    if hashlib.sha256(ranks).hexdigest() != GPT2_RANKS_SHA256:
        raise ValueError(f"{WHISPER_RANKS} in {WHISPER_SDIST} is not GPT-2's ranks (sha256 differs)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    ignore = os.path.join(os.path.dirname(path), ".gitignore")
    if not os.path.exists(ignore):  # a cache, not part of the repository
        atomic_write(ignore, lambda f: f.write("*\n"), mode="w")
    atomic_write(path, lambda f: f.write(ranks))  # never half a file in the cache


def encoding_from_ranks(path):
    """tiktoken's GPT-2 Encoding built from a gpt2.tiktoken file, checked on GPT-2's known ids."""
    import tiktoken
    with open(path, "rb") as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != GPT2_RANKS_SHA256:
        raise ValueError(f"{path} is not GPT-2's ranks (sha256 differs); delete it to fetch it again")
    # the format of tiktoken.load.load_tiktoken_bpe, read here because that function also copies
    # every file it reads into the system's temporary folder
    ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in data.splitlines() if line)}
    try:
        from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's split pattern, as tiktoken has it
    except ImportError:
        raise ValueError(f"tiktoken {tiktoken.__version__} does not export GPT-2's split pattern "
                         f"(tiktoken_ext.openai_public.r50k_pat_str); upgrade it: pip install -U tiktoken") from None
    enc = tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str,
                            mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)
    for text, ids in GPT2_KNOWN_IDS.items():
        if enc.encode(text, allowed_special="all") != ids:
            raise ValueError(f"{path} encodes {text!r} as {enc.encode(text, allowed_special='all')}, GPT-2 as {ids}")
    return enc


def gpt2_encoding(cache_dir=None):
    """(tiktoken Encoding of GPT-2's BPE, a line saying where it came from): tiktoken's own "gpt2",
    else GPT-2's ranks from the openai-whisper sdist, cached in cache_dir (default data/.cache)."""
    import socket
    import tiktoken
    # tiktoken downloads without a timeout: a network that drops packets would hang it for ever
    saved_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(30)
    try:
        return tiktoken.get_encoding("gpt2"), "tiktoken's GPT-2 BPE files"
    except Exception as e:  # no network: requests' errors; a damaged download: ValueError
        tiktoken_error = first_line(e)
    finally:
        socket.setdefaulttimeout(saved_timeout)
    path = os.path.join(cache_dir or CACHE_DIR, "gpt2.tiktoken")
    try:
        if not os.path.exists(path):
            print(f"tiktoken cannot load its GPT-2 BPE files ({tiktoken_error}); "
                  f"taking GPT-2's ranks from the {WHISPER_REQUIREMENT} sdist on PyPI")
            fetch_gpt2_ranks(path)
        enc = encoding_from_ranks(path)
    except (OSError, subprocess.SubprocessError, tarfile.TarError, KeyError, ValueError) as e:
        raise GPT2EncodingError(
            f"GPT-2's BPE files cannot be had: tiktoken.get_encoding('gpt2') failed ({tiktoken_error}; no network, "
            f"and not in TIKTOKEN_CACHE_DIR) and so did the PyPI fallback ({first_line(e)}); connect to the internet "
            f"(or to PyPI) once, point TIKTOKEN_CACHE_DIR at tiktoken's cached files, or copy openai-whisper's "
            f"whisper/assets/gpt2.tiktoken to {path}") from None
    return enc, f"GPT-2's BPE ranks from the {WHISPER_REQUIREMENT} sdist on PyPI, cached in {path}"
