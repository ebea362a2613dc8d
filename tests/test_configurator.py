"""configurator.py: config files and --key=value overrides, with clear errors."""
import pytest

from configurator import ConfigError, configure

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
    with pytest.raises(SystemExit) as e:
        check_dataset("tiny", root=str(tmp_path))
    assert e.value.code == 2
    assert capsys.readouterr().err == (f"error: dataset 'tiny' is not prepared ({named / 'val.bin'} is missing); "
                                       f"run: python data/tiny/prepare.py\n")


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
