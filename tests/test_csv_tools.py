import pytest

from csv_tools import LogError, load_log, read_rows
from tracker import LogWrapper


def write(path, content, mode="w"):
    with open(path, mode, **({} if "b" in mode else {"newline": ""})) as f:
        f.write(content)


def test_finished_and_in_progress_logs_read_the_same(tmp_path):
    log = LogWrapper(out_dir=tmp_path)
    for step in range(4):
        log.log({"iter_num": step, "train/loss": 1.0 / (step + 1)})
        log.step()
    in_progress, path = load_log(tmp_path)  # the file is still open for appending
    log.close()
    finished, _ = load_log(tmp_path)
    assert path == str(tmp_path / "log.csv")
    assert in_progress.equals(finished) and finished["iter_num"].tolist() == [0, 1, 2, 3]


def test_a_last_line_cut_short_is_dropped(tmp_path):
    write(tmp_path / "log.csv", "step,a,b\n0,1,2\n1,3,4\n2,5")
    df, _ = load_log(tmp_path)
    assert df["step"].tolist() == [0, 1] and df["b"].tolist() == [2, 4]
    header, rows = read_rows(tmp_path / "log.csv")
    assert header == ["step", "a", "b"] and list(rows) == [["0", "1", "2"], ["1", "3", "4"]]
    # a cut inside the header leaves nothing readable
    write(tmp_path / "log.csv", "step,a")
    with pytest.raises(LogError, match="empty"):
        load_log(tmp_path)


def test_short_rows_are_padded_and_the_reference_in_progress_pair_is_read(tmp_path):
    # the reference writes the header separately and only ever lengthens it
    write(tmp_path / "log_header.csv.tmp", "step,a,b\n")
    write(tmp_path / "log_data.csv.tmp", "0,1\n1,2,3\n2,4,5\n3,")
    df, path = load_log(tmp_path)
    assert path.endswith("log_data.csv.tmp")
    assert df["a"].tolist() == [1, 2, 4] and df["b"].isna().tolist() == [True, False, False]
    write(tmp_path / "log.csv", "step,a\n0,9\n")  # a finished log wins
    assert load_log(tmp_path)[0]["a"].tolist() == [9]


def test_a_path_to_the_file_itself_and_duplicate_steps(tmp_path):
    write(tmp_path / "other.csv", "step,a\n0,1\n1,2\n1,3\n0,4\n")
    df, _ = load_log(str(tmp_path / "other.csv"))
    assert df["step"].tolist() == [0, 1] and df["a"].tolist() == [4, 3]


@pytest.mark.parametrize("content, message", [
    (None, "no such directory"),
    ("", "empty"),
    ("\n\n", "empty"),
    ("step,a\n0,1\n1,2,3,4\n2,5\n", "malformed CSV"),
    ("a,b\n0,1\n", "first column is 'a'"),
    ("step,a\nzero,1\n", "not a number"),
    (b"\xff\xfe\x00binary\n", "not a text CSV"),
])
def test_bad_logs_raise_one_line_errors(tmp_path, content, message):
    out = tmp_path / "out"
    if content is not None:
        out.mkdir()
        write(out / "log.csv", content, "wb" if isinstance(content, bytes) else "w")
    with pytest.raises(LogError, match=message) as e:
        load_log(str(out))
    assert "\n" not in str(e.value)


def test_a_directory_without_a_log(tmp_path):
    with pytest.raises(LogError, match="no log.csv"):
        load_log(str(tmp_path))
