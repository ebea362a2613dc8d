"""train.py's CPU threads sleep while they wait for each other (OMP_WAIT_POLICY=PASSIVE unless one is
given): spinning, they burn the time slices of a machine shared with other work. Read from what the
OpenMP runtime itself says it runs with (OMP_DISPLAY_ENV, GNU OpenMP's, which torch's Linux wheels
carry)."""
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO


def openmp_settings(**env):
    """{name: value} of the OpenMP runtime's settings as train.py starts (its --help loads torch)."""
    env = {k: v for k, v in dict(os.environ, OMP_DISPLAY_ENV='VERBOSE', **env).items() if v is not None}
    p = subprocess.run([sys.executable, os.path.join(REPO, 'train.py'), '--help'], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return dict(re.findall(r"^\s+(\w+) = '([^']*)'", p.stderr, re.M))


def test_train_py_threads_sleep_while_they_wait():
    settings = openmp_settings(OMP_WAIT_POLICY=None, GOMP_SPINCOUNT=None)
    if 'GOMP_SPINCOUNT' not in settings:
        pytest.skip("torch here does not run on GNU OpenMP, whose settings this reads")
    assert settings['OMP_WAIT_POLICY'] == 'PASSIVE' and settings['GOMP_SPINCOUNT'] == '0'


@pytest.mark.parametrize("given", [dict(OMP_WAIT_POLICY='ACTIVE'), dict(GOMP_SPINCOUNT='300000')])
def test_a_wait_policy_given_is_kept(given):
    settings = openmp_settings(**{'OMP_WAIT_POLICY': None, 'GOMP_SPINCOUNT': None, **given})
    if 'GOMP_SPINCOUNT' not in settings:
        pytest.skip("torch here does not run on GNU OpenMP, whose settings this reads")
    assert all(settings[k] == v for k, v in given.items()) and int(settings['GOMP_SPINCOUNT']) > 0
