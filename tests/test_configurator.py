"""configurator.py: config files and --key=value overrides, with clear errors."""
import os
import re
import subprocess
import sys
from ast import literal_eval

import pytest

from configurator import ConfigError, configure
from conftest import REPO

DEFAULTS = dict(batch_size=12, learning_rate=6e-4, compile=True, dataset='owt', cos_attn=[], init=None)


def test_overrides_parse_literals_and_promote_int_to_float():
    cfg = dict(DEFAULTS)
    configure(["--batch_size=32", "--learning_rate=1", "--compile=False", "--dataset=shakespeare_char",
               "--cos_attn=[1, 2]"], cfg)
    assert cfg['batch_size'] == 32
    assert cfg['learning_rate'] == 1.0 and isinstance(cfg['learning_rate'], float)
    assert cfg['compile'] is False
    assert cfg['dataset'] == 'shakespeare_char'
    assert cfg['cos_attn'] == [1, 2]


def test_config_file_then_override(tmp_path):
    f = tmp_path / "c.py"
    f.write_text("batch_size = 64\nimport math\nlearning_rate = math.sqrt(4e-6)\n")
    cfg = dict(DEFAULTS)
    configure([str(f), "--batch_size=8"], cfg)
    assert cfg['batch_size'] == 8
    assert cfg['learning_rate'] == pytest.approx(2e-3)
    assert 'math' not in cfg


@pytest.mark.parametrize("argv, words", [
    (["--bogus=1"], "unknown config key 'bogus'"),
    (["--batch_size=abc"], "--batch_size expects int"),
    (["--batch_size=1.5"], "--batch_size expects int"),
    (["--compile=1"], "--compile expects bool"),
    (["--batch_size"], "expected --key=value"),
    (["no_such_file.py"], "not found"),
])
def test_bad_input_is_a_config_error(argv, words):
    with pytest.raises(ConfigError, match=words.replace('[', r'\[')):
        configure(argv, dict(DEFAULTS))


def test_config_file_with_unknown_key_or_error(tmp_path):
    f = tmp_path / "c.py"
    f.write_text("batch_sise = 64\n")
    with pytest.raises(ConfigError, match="unknown key 'batch_sise'"):
        configure([str(f)], dict(DEFAULTS))
    f.write_text("batch_size = 1/0\n")
    with pytest.raises(ConfigError, match="ZeroDivisionError"):
        configure([str(f)], dict(DEFAULTS))


def test_help_lists_keys(capsys):
    with pytest.raises(SystemExit) as e:
        configure(["--help"], dict(DEFAULTS), "Train a GPT.")
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "Train a GPT." in out and "--batch_size=12" in out


def test_help_shows_each_keys_comment_from_the_script(tmp_path, monkeypatch, capsys):
    script = tmp_path / "train_like.py"
    script.write_text("# the batch\nbatch_size = 12  # examples per micro-step\nwarmup = None\n"
                      "if True:\n    dropout = 0.1  # not a top-level key\nlabel = 'a#b'  # the real comment\n")
    monkeypatch.setattr("sys.argv", [str(script), "--help"])
    with pytest.raises(SystemExit):
        configure(["--help"], dict(batch_size=12, warmup=None, dropout=0.0, label='a#b'), "doc")
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  --batch_size=12"))
    assert lines[at].endswith("  examples per micro-step") and lines[at - 1] == "  # the batch"
    assert "  --warmup=None" in lines and "  --dropout=0.0" in lines  # no comment: nothing beside it
    assert any(line.startswith("  --label='a#b'") and line.endswith("  the real comment") for line in lines)


def test_paper_config_splits_over_the_gpus_it_names():
    """config/train_cgpt_111M_owt.py: the paper's step of 120 sequences of 2048 tokens, with global
    accumulation steps that train.py can divide over 1, 2, 4 or 8 DDP processes."""
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = {}
    with open(os.path.join(root, 'config', 'train_cgpt_111M_owt.py')) as f:
        exec(f.read(), {}, cfg)
    assert cfg['batch_size'] * cfg['gradient_accumulation_steps'] == 120 and cfg['block_size'] == 2048
    assert all(cfg['gradient_accumulation_steps'] % gpus == 0 for gpus in (1, 2, 4, 8))


def test_a_config_file_value_of_the_wrong_type_is_refused(tmp_path):
    f = tmp_path / "c.py"
    f.write_text("batch_size = '64'\n")
    with pytest.raises(ConfigError, match=r"batch_size \(set in .*c\.py\) expects int"):
        configure([str(f)], dict(DEFAULTS))
    f.write_text("learning_rate = 1\ncos_attn = (1, 2)\n")  # an int for a float, a tuple for a list
    cfg = dict(DEFAULTS)
    configure([str(f)], cfg)
    assert cfg['learning_rate'] == 1.0 and isinstance(cfg['learning_rate'], float) and cfg['cos_attn'] == [1, 2]


def test_a_nanogpt_style_script_that_execs_this_file_gets_its_overrides(tmp_path):
    """nanoGPT's train.py and sample.py (and the reference's train.py) apply the command line with
    exec(open('configurator.py').read()); the overrides must reach the script's globals."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "script.py"
    script.write_text("batch_size = 12\nlearning_rate = 6e-4\ndataset = 'owt'\n"
                      "exec(open('configurator.py').read())\nprint('got', batch_size, learning_rate, dataset)\n")
    cfg_file = tmp_path / "cfg.py"
    cfg_file.write_text("dataset = 'shakespeare'\n")
    p = subprocess.run([sys.executable, str(script), str(cfg_file), "--batch_size=32", "--learning_rate=1"],
                       cwd=root, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "got 32 1.0 shakespeare" in p.stdout
    p = subprocess.run([sys.executable, str(script), "--batch_size=abc"], cwd=root, capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.strip() == "error: --batch_size expects int (default 12), got 'abc'"


def test_configure_train_checks_the_values_with_where_each_was_set_and_exits_2_on_bad_input(tmp_path, monkeypatch,
                                                                                              capsys):
    import configurator
    f = tmp_path / "c.py"
    f.write_text("batch_size = 64\n")
    checked = []
    monkeypatch.setattr(configurator, "check_train_config", lambda config, places: checked.append((dict(config), places)))
    configurator.configure_train([str(f), "--learning_rate=1"], dict(DEFAULTS))
    assert checked == [({**DEFAULTS, 'batch_size': 64, 'learning_rate': 1.0},
                        {'batch_size': (str(f), 0), 'learning_rate': ("the command line", 1)})]
    with pytest.raises(SystemExit) as e:
        configurator.configure_train(["--bogus=1"], dict(DEFAULTS))
    assert e.value.code == 2 and capsys.readouterr().err == "error: unknown config key 'bogus'; see --help\n"


def test_check_dataset_finds_a_prepared_one_by_name_or_path_and_says_how_to_prepare_one(tmp_path, capsys):
    from configurator import check_dataset
    named = tmp_path / "data" / "tiny"
    named.mkdir(parents=True)
    for split in ("train", "val"):
        (named / f"{split}.bin").write_bytes(b"\0\0")
    assert check_dataset("tiny", root=str(tmp_path)) == str(named)
    assert check_dataset(str(named), root="/nowhere") == str(named)
    (named / "val.bin").unlink()
    (named / "prepare.py").write_text("")
    with pytest.raises(SystemExit) as e:
        check_dataset("tiny", root=str(tmp_path))
    assert e.value.code == 2
    assert capsys.readouterr().err == (f"error: dataset 'tiny' is not prepared ({named / 'val.bin'} is missing); "
                                       f"run: python data/tiny/prepare.py\n")


def test_a_dataset_without_a_prepare_script_is_not_told_to_run_one_and_the_datasets_there_are_listed(tmp_path,
                                                                                                       capsys):
    from configurator import check_dataset
    for name, files in (("made", ("train.bin", "val.bin")), ("raw", ("prepare.py",)), ("empty", ())):
        (tmp_path / "data" / name).mkdir(parents=True)
        for file in files:
            (tmp_path / "data" / name / file).write_bytes(b"")
    for dataset in ("nosuchdata", "empty"):
        with pytest.raises(SystemExit) as e:
            check_dataset(dataset, root=str(tmp_path))
        assert e.value.code == 2
        assert capsys.readouterr().err == (
            f"error: dataset {dataset!r} is not prepared ({tmp_path / 'data' / dataset / 'train.bin'} is missing) and "
            f"there is no data/{dataset}/prepare.py; prepared datasets: made; not yet prepared: raw "
            f"(run python data/<name>/prepare.py)\n")


def test_a_setting_without_its_dashes_is_not_called_a_missing_config_file():
    for arg in ("max_iters=5", "-max_iters=5"):
        with pytest.raises(ConfigError, match=re.escape(f"{arg!r} is not a config file; did you mean --max_iters=5?")):
            configure([arg], dict(DEFAULTS, max_iters=None))
    with pytest.raises(ConfigError, match=re.escape("config file 'nokey=5' not found")):
        configure(["nokey=5"], dict(DEFAULTS))


def test_host_memory_is_lowered_by_an_address_space_limit(monkeypatch):
    import resource
    import configurator
    free = configurator.host_memory()
    assert free is None or free > 0
    monkeypatch.setattr(resource, "getrlimit", lambda which: (
        (5 << 40, resource.RLIM_INFINITY) if which == resource.RLIMIT_AS else (resource.RLIM_INFINITY,) * 2))
    assert configurator.host_memory() < 5 << 40  # what this process has mapped is already spent


def memory_config(**changes):
    """The keys check_memory reads, of a GPT-2 (124M) run on a character dataset."""
    return dict(dict(init_from='scratch', n_layer=12, n_embd=768, block_size=1024, batch_size=12, mlp='gelu',
                     pos_emb='learned', tie_embeddings=True, dtype='float32', device='cpu', out_dir='out'), **changes)


@pytest.mark.parametrize("changes, device_type, words", [
    (dict(n_layer=100000), "cpu", "--n_layer=100000 --n_embd=768: a model of 707,789,636,352 parameters needs "
                                     "10,546.9 GiB for its weights, gradients and AdamW state, more than the 8.0 GiB"),
    (dict(n_layer=2, n_embd=65536), "cpu", "--n_layer=2 --n_embd=65536: a model of 103,150,583,808 parameters"),
    (dict(init_from='gpt2-xl'), "cpu", "--init_from=gpt2-xl: a model of 1,556,609,600 parameters"),
    (dict(batch_size=100000000), "cpu", "--batch_size=100000000 --block_size=1024: one micro-batch's tokens, "
                                        "activations and logits need "),
    (dict(n_layer=100), "cuda", "--n_layer=100 --n_embd=768: a model of 708,625,152 parameters needs 10.6 GiB"),
    (dict(batch_size=64), "cuda", "--batch_size=64 --block_size=1024: one micro-batch's tokens, activations and"),
])
def test_a_model_or_a_batch_that_cannot_fit_in_memory_is_refused_in_one_line(monkeypatch, capsys, changes,
                                                                            device_type, words):
    import configurator
    from configurator import check_memory
    monkeypatch.setattr(configurator, "host_memory", lambda: 8 << 30)  # not this machine's, whatever it has
    monkeypatch.setattr(configurator, "available_memory", lambda kind, index=None: 8 << 30)  # a GPU's
    check_memory(memory_config(), device_type, 65)  # GPT-2 (124M) of a character vocabulary fits
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit) as e:
        check_memory(memory_config(**changes), device_type, 65)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {words}"), err
    assert ("free on cuda:0" if device_type == "cuda" else "of memory this machine has available") in err


def test_an_evaluation_alone_needs_room_for_the_weights_and_logits_only(monkeypatch, capsys):
    import configurator
    from configurator import check_memory
    monkeypatch.setattr(configurator, "host_memory", lambda: 8 << 30)
    check_memory(memory_config(n_layer=100, batch_size=64, eval_only=True), "cpu", 65)  # 2.6 GiB of weights
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit):  # training: 10.6 GiB with the gradients and AdamW's moments
        check_memory(memory_config(n_layer=100, batch_size=64), "cpu", 65)


@pytest.mark.parametrize("args, words", [
    (["--block_size=100000000"], "--block_size=100000000 is more than the data can give: train.bin holds 16,200 tokens"),
    (["--n_layer=100000", "--n_embd=768", "--n_head=12"], "--n_layer=100000 --n_embd=768: a model of"),
    (["--n_embd=65536", "--n_head=1"], "--n_layer=2 --n_embd=65536: a model of"),
    (["--batch_size=100000000"], "--batch_size=100000000 --block_size=16: one micro-batch's tokens"),
    (["--bs_schedule=True", "--bs_schedule_points=[(0,-3)]"], "--bs_schedule_points=[(0, -3)]: each point is (tokens "
                                                              ">= 0, global accumulation steps > 0), not (0, -3)"),
    (["--bs_schedule=True", "--bs_schedule_points=[(0, 1), 5]"], "--bs_schedule_points=[(0, 1), 5]: each point"),
    (["--bs_schedule=True", "--bs_schedule_points=[(0, 1), (10, 1e9)]", "--max_iters=10"],
     "1000000000.0 accumulation steps is over the bound of 10 for --max_tokens=640"),
    (["--bs_schedule_points=[(0, float('nan'))]"], "--bs_schedule_points expects list"),  # not a literal: a string
    (["--bs_schedule=True", "--bs_schedule_points=[(1e400, 1)]"], "--bs_schedule_points=[(inf, 1)]: each point is"),
    (["max_iters=5"], "'max_iters=5' is not a config file; did you mean --max_iters=5?"),
])
def test_what_cannot_run_is_refused_before_anything_is_built_or_written(tiny_dataset, tmp_path, monkeypatch, args,
                                                                       words):
    import configurator
    from conftest import TINY
    from test_train import train_until_exit
    monkeypatch.setattr(configurator, "host_memory", lambda: 8 << 30)  # not this machine's, whatever it has
    code, stderr = train_until_exit(f"--dataset={tiny_dataset}", f"--out_dir={tmp_path / 'o'}", *TINY, *args)
    assert code == 2, stderr
    err = stderr.strip().splitlines()
    assert len(err) == 1 and words in err[0], stderr
    assert not (tmp_path / 'o').exists()  # no lock taken, nothing written


def test_an_out_dir_that_is_a_link_to_nothing_is_said_to_be_one(tiny_dataset, tmp_path):
    from conftest import TINY
    from test_train import train_until_exit
    os.symlink(tmp_path / "gone", tmp_path / "link")
    code, stderr = train_until_exit(f"--dataset={tiny_dataset}", f"--out_dir={tmp_path / 'link' / 'run'}", *TINY)
    assert code == 2
    assert stderr == (f"error: --out_dir='{tmp_path / 'link' / 'run'}' cannot be made: {tmp_path / 'link'} is a "
                      f"symbolic link to '{tmp_path / 'gone'}', which does not exist\n")


def test_dataset_vocab_size_is_meta_pkls_or_none_for_gpt2s_bpe(tmp_path, capsys):
    import pickle
    from configurator import dataset_vocab_size
    assert dataset_vocab_size(str(tmp_path)) is None
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump({'vocab_size': 65, 'itos': {}, 'stoi': {}}, f)
    assert dataset_vocab_size(str(tmp_path)) == 65
    assert capsys.readouterr().out == f"found vocab_size = 65 (inside {tmp_path / 'meta.pkl'})\n"


@pytest.mark.parametrize("args, words", [
    (["--init_from=gpt2-xxl"], "--init_from='gpt2-xxl' is not one of scratch, resume, gpt2, gpt2-medium, gpt2-large, "
                               "gpt2-xl"),
    (["--min_lr=1e-2", "--learning_rate=1e-3"], "--min_lr=0.01 is above --learning_rate=0.001"),
    (["--batch_size=True"], "--batch_size expects int (default 4), got 'True'"),
    (["--compile=3"], "--compile expects bool (True/False), got '3'"),
    (["--dataset=/etc"], "dataset '/etc' is not prepared (/etc/train.bin is missing); a dataset folder holds "
                         "train.bin and val.bin, as data/<name>/prepare.py writes them"),
    (["--dataset="], "--dataset='' must name a folder under data/ or a path to one"),
])
def test_bad_values_are_one_line_and_exit_2(tiny_dataset, tmp_path, args, words):
    from conftest import TINY
    from test_train import train_until_exit
    code, stderr = train_until_exit(f"--dataset={tiny_dataset}", f"--out_dir={tmp_path / 'o'}", *TINY, *args)
    assert code == 2, stderr
    err = stderr.strip().splitlines()
    assert len(err) == 1 and words in err[0], stderr


@pytest.mark.slow
def test_a_value_that_is_merely_unused_is_one_warning(tiny_dataset, tmp_path):
    from conftest import TINY
    from test_train import train_until_exit
    code, stderr = train_until_exit(f"--dataset={tiny_dataset}", f"--out_dir={tmp_path / 'o'}", *TINY, "--max_iters=1",
                                    "--bs_schedule_points=[(0, 1), (100, 2)]", "--min_lr=1.0", "--decay_lr=False")
    assert code == 0
    assert stderr.strip().splitlines() == ["warning: --bs_schedule_points is unused without --bs_schedule=True"]


def test_a_meta_pkl_that_is_not_a_small_regular_file_is_refused_before_it_is_read(tmp_path):
    """meta.pkl was unpickled from whatever was there: a FIFO blocked, a huge file was read whole."""
    import pickle
    from configurator import MAX_META_BYTES, dataset_vocab_size, read_meta
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 65}))
    assert dataset_vocab_size(str(tmp_path), quiet=True) == 65
    with open(tmp_path / "meta.pkl", "ab") as f:
        f.truncate(MAX_META_BYTES + 1)  # sparse: no disk used
    with pytest.raises(ValueError, match="larger than"):
        dataset_vocab_size(str(tmp_path), quiet=True)
    os.mkfifo(tmp_path / "fifo.pkl")  # opened for reading, it would wait for a writer
    with pytest.raises(ValueError, match="not a regular file"):
        read_meta(str(tmp_path / "fifo.pkl"))


def test_under_torchrun_the_first_process_says_it_and_the_others_leave_after_it(monkeypatch, capsys):
    """torchrun stops every process as soon as one exits: a process other than the node's first
    waits (a bounded time) before its exit 2, so the first one's line is not cut off."""
    import configurator
    slept = []
    monkeypatch.setattr(configurator.time, "sleep", slept.append)
    for local_rank, said, waited in (("0", "error: bad\n", []), ("1", "", [configurator.FIRST_SAYS_IT_SECONDS])):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        slept.clear()
        with pytest.raises(SystemExit) as stop:
            configurator.die("bad")
        assert stop.value.code == 2 and capsys.readouterr().err == said and slept == waited


MADE_UP = 'no-such-value'


def help_rows():
    """{key: (default, comment)} of train.py's --help, as a user reads it."""
    p = subprocess.run([sys.executable, os.path.join(REPO, 'train.py'), '--help'], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert p.returncode == 0, p.stderr
    rows = [re.match(r"  --(\w+)=(.*?)(?:\s{2,}(.*))?$", line) for line in p.stdout.splitlines()]
    return {m[1]: (literal_eval(m[2]), m[3] or '') for m in rows if m}


def listed_values(comment):
    """The values a key's help comment lists: in each clause (split at ':' and ';', asides in parentheses
    left out), the quoted words ('scratch' or 'resume'), or a clause that is nothing but words joined by
    ', ' and ' or ' (nn, gns or shim). A '*' (gpt2*) stands for nothing."""
    values = []
    for clause in re.split(r'[:;]', re.sub(r'\([^)]*\)', '', comment)):
        clause = re.sub(r'\s+,', ',', clause).strip()
        quoted = re.findall(r"'([\w.*-]+)'", clause)
        if quoted:
            values += quoted
        elif re.fullmatch(r"(or )?[\w.-]+((, | or )[\w.-]+)+", clause):
            values += re.split(r', | or ', clause.removeprefix('or '))
    return [v.replace('*', '') for v in values]


def test_every_value_help_lists_for_a_choice_flag_is_accepted(capsys):
    """A choice flag: one whose made-up word and number are both refused. Each value its --help lists
    must be accepted, or refused for another reason than a made-up word is (bs_gns_group='adam'
    needs --gns_adam=True)."""
    import configurator
    rows = help_rows()
    config = {key: default for key, (default, _) in rows.items()}

    def why_refused(key, value):
        """check_train_config's line for key=value with the value written as MADE_UP; None: accepted."""
        capsys.readouterr()
        try:
            configurator.check_train_config({**config, key: value})
        except SystemExit:
            return capsys.readouterr().err.replace(repr(value), repr(MADE_UP))
        return None
    choices = {key: comment for key, (default, comment) in rows.items() if (default is None or isinstance(default, str))
               and why_refused(key, MADE_UP) and why_refused(key, 1)}
    assert {'linearclass', 'embeddingclass', 'lnclass', 'init_from', 'norm', 'per_example_mode'} <= set(choices)
    wrong = []
    for key, comment in choices.items():
        made_up = why_refused(key, MADE_UP)
        for value in listed_values(comment):
            why = why_refused(key, value)
            if why == made_up:
                wrong.append(f"--{key}={value} ({why.strip()})")
    assert not wrong, f"--help lists values that are refused: {'; '.join(wrong)}"
    # and the layer-class flags list every value there is
    from nanogns.layers.config import FLAG_CLASSES
    for flag, table in FLAG_CLASSES.items():
        assert sorted(listed_values(choices[flag])) == sorted(table), flag
