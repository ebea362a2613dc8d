import os
import warnings

import numpy as np
import pandas as pd
import pytest

from nanogns.logread import LogError, load_log, log_columns, step_ranges
from nanogns.runlog import LogWrapper


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


def test_a_row_cut_short_after_whole_rows_is_left_out_with_a_warning(tmp_path):
    write(tmp_path / "log.csv", "step,a,b,c\n0,1,2,3\n1,3,4,5\n12,,\n2,5,6,7\n3,\n")
    with pytest.warns(UserWarning, match=r"2 row\(s\) with fewer cells than a row before them left out "
                                         r"\(cut short; step cells 12, 3\)"):
        df, _ = load_log(tmp_path)
    assert df["step"].tolist() == [0, 1, 2] and df["b"].tolist() == [2, 4, 6]
    # a quoted cell's commas are not cells
    write(tmp_path / "log.csv", 'step,a,b\n0,"x,y",2\n1,3,4\n')
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_log(tmp_path, as_written=("a",))[0]["step"].tolist() == [0, 1]


def test_a_path_to_the_file_itself_and_duplicate_steps(tmp_path):
    write(tmp_path / "other.csv", "step,a\n0,1\n1,2\n1,3\n0,4\n")
    path = str(tmp_path / "other.csv")
    with pytest.warns(UserWarning) as caught:
        df, _ = load_log(path)
    assert [str(w.message) for w in caught] == [
        f"{path}: steps 0-1 appear twice with different values: the later copy is kept"]
    assert df["step"].tolist() == [0, 1] and df["a"].tolist() == [4, 3]
    # copies that repeat their row say nothing new; a third copy; differences only in columns not read
    write(tmp_path / "log.csv", "step,a,b\n0,1,5\n1,2,5\n2,3,5\n1,2,5\n2,3,6\n2,3,7\n5,1,1\n3,1,1\n")
    with pytest.warns(UserWarning) as caught:
        df, _ = load_log(tmp_path)
    assert [str(w.message) for w in caught] == [
        f"{tmp_path / 'log.csv'}: step 2 appears more than once with different values: the last copy of each is kept"]
    assert df["step"].tolist() == [0, 1, 2, 3, 5] and df["b"].tolist() == [5, 5, 7, 1, 1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_log(tmp_path, ["a"])[0]["a"].tolist() == [1, 2, 3, 1, 1]


def test_step_ranges():
    assert step_ranges([4]) == "step 4"
    assert step_ranges([3, 10, 11, 12, 40]) == "steps 3, 10-12, 40"
    assert step_ranges(list(range(0, 40, 2)), shown=3) == "steps 0, 2, 4, ... (20 steps)"


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


def test_load_csv_is_the_reference_name_for_the_frame(tmp_path):
    from nanogns.logread import load_csv
    write(tmp_path / "log.csv", "step,a\n0,1\n1,2\n")
    assert load_csv(str(tmp_path)).equals(load_log(str(tmp_path))[0])


def test_the_reference_tensor_loss_cells_are_numbers(tmp_path):
    # an old reference bug logged 0-dim tensors: csv wrote str(tensor), quoted where it has a comma
    write(tmp_path / "log.csv", "step,train/loss,val/loss,note\n"
                                "0,tensor(4.2000),\"tensor(4.3000, device='cuda:0')\",tensor(1.0)\n"
                                "1,3.5,tensor(1.2346e-05),abc\n2,,tensor(nan),x tensor(2.0)\n")
    df, _ = load_log(tmp_path)
    assert df["train/loss"].dtype == float and df["train/loss"].tolist()[:2] == [4.2, 3.5]
    assert df["val/loss"].dtype == float and df["val/loss"].tolist()[:2] == [4.3, 1.2346e-05]
    assert df["val/loss"].isna().tolist() == [False, False, True] and df["train/loss"].isna().tolist()[2]
    # a column with other text keeps it; its tensor cells are still numbers
    assert df["note"].tolist() == [1.0, "abc", "x tensor(2.0)"]


def test_missing_cells_as_pandas_reads_them_or_as_written(tmp_path):
    """'nan' or 'None' are missing as pandas reads a CSV; as written, only an empty cell is (the analysis
    tells a value that went wrong from one never logged)."""
    write(tmp_path / "log.csv", "step,a,b,c\n0,1,nan,inf\n1,,None,1e400\n2,3,,2\n")
    df, _ = load_log(tmp_path)
    assert df["a"].isna().tolist() == [False, True, False] and df["b"].isna().all()
    assert df["c"].tolist() == [np.inf, np.inf, 2.0]
    df, _ = load_log(tmp_path, as_written=["b", "c"])
    assert df["b"].tolist()[:2] == ["nan", "None"] and df["b"].isna().tolist() == [False, False, True]
    assert df["a"].isna().tolist() == [False, True, False] and df["c"].tolist() == [np.inf, np.inf, 2.0]


def test_the_missing_value_words_are_pandas_own():
    parsers = pytest.importorskip("pandas._libs.parsers")
    from nanogns.logread import PANDAS_NA
    assert set(PANDAS_NA) == set(parsers.STR_NA_VALUES)


def test_reading_some_columns(tmp_path):
    write(tmp_path / "log.csv", "step,a,b,c\n0,1,x\n1,2,y,0.5\n")  # a short row before the header grew
    df, path = load_log(tmp_path, ["c", "a", "not in the log"])
    assert list(df.columns) == ["step", "a", "c"] and df["c"].isna().tolist() == [True, False]
    assert df["a"].dtype == np.int64 and df["step"].dtype == np.int64, "integer columns stay integer"
    assert log_columns(tmp_path) == (["step", "a", "b", "c"], path)
    # a row longer than the header is refused whichever columns are read
    write(tmp_path / "log.csv", "step,a,b\n0,1,2\n1,2,3,4,5\n2,3,4\n")
    for columns in (None, ["a"]):
        with pytest.raises(LogError, match="data row 2 has more cells than the header's 3"):
            load_log(tmp_path, columns)


def test_log_columns_reads_the_header_alone(tmp_path):
    write(tmp_path / "log_header.csv.tmp", "step,a,b\n")
    write(tmp_path / "log_data.csv.tmp", "0,1,2,3,4\n")  # not read
    assert log_columns(tmp_path)[0] == ["step", "a", "b"]
    write(tmp_path / "log.csv", "a,step\n0,1\n")
    with pytest.raises(LogError, match="first column is 'a'"):
        log_columns(tmp_path)
    write(tmp_path / "log.csv", "step,a,a\n0,1,2\n")
    with pytest.raises(LogError, match="'a' appears twice"):
        load_log(tmp_path)


def test_a_log_that_cannot_be_read(tmp_path, monkeypatch):
    import nanogns.logread as csv_tools
    write(tmp_path / "log.csv", "step,a\n0,1\n")

    def refuse(path, *args, **kwargs):  # as root, file permissions do not stop a read
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(csv_tools, "open", refuse, raising=False)
    with pytest.raises(LogError, match="cannot read \\(Permission denied\\)"):
        load_log(tmp_path)


def test_a_long_log_is_streamed_not_held_as_text(tmp_path, monkeypatch):
    """The rows reach pandas in pieces: the text of the file is never one string."""
    import nanogns.logread as csv_tools
    rows = "".join(f"{i},{i * 0.5}\n" for i in range(200_000))
    write(tmp_path / "log.csv", "step,a\n" + rows + "200000,1")  # ~2.5 MB, last line cut
    largest = []
    read = csv_tools._Stream.readinto

    def spy(self, buffer):
        n = read(self, buffer)
        largest.append(n)
        return n

    monkeypatch.setattr(csv_tools._Stream, "readinto", spy)
    df, _ = load_log(tmp_path)
    assert len(df) == 200_000 and df["a"].iloc[-1] == 199_999 * 0.5
    assert sum(largest) == len(rows) + len("0,0,0\n") and max(largest) < len(rows) / 4


def test_header_and_rows_come_from_one_file(tmp_path, monkeypatch):
    """A LogWrapper swapping in a longer header (os.replace) between reading the header and the rows."""
    import nanogns.logread as csv_tools
    write(tmp_path / "log.csv", "step,a\n0,1\n1,2\n")
    read_header = csv_tools._read_header

    def then_replaced(path, f):
        header = read_header(path, f)
        write(tmp_path / "log.tmp", "step,a,b\n0,1,\n1,2,\n2,3,4\n")
        os.replace(tmp_path / "log.tmp", tmp_path / "log.csv")
        return header

    monkeypatch.setattr(csv_tools, "_read_header", then_replaced)
    df, _ = load_log(tmp_path)
    assert list(df.columns) == ["step", "a"] and df["a"].tolist() == [1, 2]


def test_a_figure_without_colour_tells_its_curves_apart():
    """Written to a file or a pipe (stdout is not a terminal under pytest), every curve has its own character,
    shown in the legend: without colour they would all be the same braille dots."""
    import numpy as np
    from nanogns.logread import MARKERS, figure
    x = np.arange(40.0)
    text = figure([(x, np.sin(x / 5), "first"), (x, np.cos(x / 5), "second")], "x", "y", width=40, height=8)
    legend = text[text.index("Legend"):]
    assert f"{MARKERS[0]}⠤ first" in legend and f"{MARKERS[1]}⠤ second" in legend
    body = text[:text.index("Legend")]
    assert body.count(MARKERS[0]) > 5 and body.count(MARKERS[1]) > 5
    assert "\x1b[" not in text  # no colour codes in the file
    assert MARKERS[0] not in figure([(x, np.sin(x / 5), "first")], "x", "y", colour=True).split("Legend")[0]
