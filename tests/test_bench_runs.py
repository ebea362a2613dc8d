"""bench/runs.py's dies_with_parent: a bench script killed outright (kill -9) takes the train.py it
started with it, so that no run goes on writing beside the next one; and every child process a
bench script starts is started so."""
import ast
import glob
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO

LINUX = sys.platform.startswith('linux')


def children_of(pid):
    """The pids whose parent is `pid`, from /proc."""
    found = []
    for entry in os.listdir('/proc'):
        if entry.isdigit():
            try:
                with open(f'/proc/{entry}/stat') as f:
                    fields = f.read().rsplit(')', 1)[1].split()  # after the command's name: state, ppid, ...
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def running(pid):
    """Whether `pid` is a live process (a zombie waiting for its reaper is not)."""
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
    except OSError:
        return False


def command_line(pid):
    try:
        with open(f'/proc/{pid}/cmdline', 'rb') as f:
            return f.read().decode(errors='replace').split('\0')
    except OSError:
        return []


@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="a child dies with its parent through Linux's prctl(PR_SET_PDEATHSIG)")
@pytest.mark.parametrize("script, args", [
    ("critical_batch.py", ["--quick"]),  # its train.py through runs.train_once
    ("figure_runs.py", []),  # two train.py at once, through its own Popen
])
def test_a_bench_script_killed_outright_takes_its_train_py_with_it(tmp_path, tiny_dataset, script, args):
    # --eval_iters: each train.py sits in its first evaluation for minutes, long after the parent is gone
    cmd = [sys.executable, os.path.join(REPO, 'bench', script), *args, f'--out_dir={tmp_path / "out"}',
           f'--dataset={tiny_dataset}', '--eval_iters=1000000']
    parent = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=dict(os.environ, OMP_NUM_THREADS='1', WANDB_MODE='disabled'))
    trains = []
    try:
        deadline = time.monotonic() + 180
        while not trains:
            assert parent.poll() is None, f"{script} ended (exit {parent.returncode}) before starting train.py"
            assert time.monotonic() < deadline, f"{script} started no train.py within 180 s"
            time.sleep(0.2)
            trains = [pid for pid in children_of(parent.pid)
                      if any(word.endswith('train.py') for word in command_line(pid))]
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(running(pid) for pid in trains):
            assert time.monotonic() < deadline, f"train.py {trains} still running 10 s after {script} was killed"
            time.sleep(0.1)
    finally:
        for pid in [parent.pid, *trains]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        parent.wait(timeout=30)


def test_every_child_a_bench_script_starts_dies_with_it():
    """Each subprocess.run / Popen in bench/ passes preexec_fn=dies_with_parent()."""
    missing = []
    for path in sorted(glob.glob(os.path.join(REPO, 'bench', '*.py'))):
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == 'subprocess'
                    and node.func.attr in ('run', 'Popen', 'call', 'check_call', 'check_output')):
                given = {k.arg: k.value for k in node.keywords}
                value = given.get('preexec_fn')
                if not (isinstance(value, ast.Call) and getattr(value.func, 'id', None) == 'dies_with_parent'):
                    missing.append(f"{os.path.basename(path)}:{node.lineno}")
    assert not missing, f"children that outlive a killed bench script: {', '.join(missing)}"
