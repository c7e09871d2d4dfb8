"""What a rank can do to the process that launched it: send plain data home, and nothing else.

A rank runs code the parent does not trust (under grading, a submission's), so its result is
decoded by torch's restricted unpickler (``labs.runtime.wire``): an object whose unpickling would
run code is refused, and nothing of it runs here. ``protect_from_ranks`` and ``keep_from_ranks``
(``labs.runtime.isolation``) close the other ways in: the parent's memory and descriptors.
"""

import json
import math
import os
import pickle
import subprocess
import sys
import textwrap
from collections import Counter, OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from labs import launch
from labs.runtime import RankError, wire
from labs.runtime.errors import REFUSED
from tests.helpers import ROOT

MARKER_ENV = "LABS_TEST_MARKER"  # the file a payload writes if its unpickling ever runs


class RunsCodeWhenUnpickled:
    """Unpickling this calls exec: what an attacker's rank would send."""

    def __reduce__(self):
        code = f"open({os.environ[MARKER_ENV]!r}, 'w').write('ran in the parent')"
        return (exec, (code,))


def return_code_runner():
    return {"loss": 1.0, "payload": RunsCodeWhenUnpickled()}


def send_raw_pickle_then_return():
    """Bypass the launcher's encoder: write a plain pickle on the channel to the parent."""
    from labs.runtime import rank

    rank._parent_conn.send_bytes(pickle.dumps(("ok", RunsCodeWhenUnpickled(), "gloo")))
    return 0


def progress_with_a_code_runner():
    from labs.runtime import rank

    rank._parent_conn.send_bytes(wire.encode(("progress", RunsCodeWhenUnpickled())))
    return 0


@pytest.fixture
def marker(tmp_path, monkeypatch):
    path = tmp_path / "ran"
    monkeypatch.setenv(MARKER_ENV, str(path))
    return path


@pytest.mark.parametrize(
    "fn, named",
    [
        (return_code_runner, "its result needs builtins.exec"),
        (send_raw_pickle_then_return, "what it sent is not a launcher message"),
        (progress_with_a_code_runner, "its result needs builtins.exec"),
    ],
)
def test_a_rank_cannot_run_code_in_the_parent(marker, fn, named):
    with pytest.raises(RankError) as info:
        launch(fn, 2, progress=1 if fn is progress_with_a_code_runner else None)
    assert info.value.exc_type == REFUSED
    assert str(info.value).startswith(f"rank 0 sent a result the launcher refused: {named}")
    assert not marker.exists()  # nothing of the rank's bytes ran here


def test_the_audit_of_the_channel_can_fail(marker):
    """The same bytes, unpickled as the launcher used to (``pickle.loads``): the code runs. So
    the test above would catch a launcher that went back to it."""
    pickle.loads(pickle.dumps(return_code_runner()))
    assert marker.read_text() == "ran in the parent"


def return_plain_data():
    rank = dist.get_rank()
    return {
        "rank": rank,
        "floats": [1.5, math.inf, -0.0],
        "nested": ({"a": (1, 2)}, [None, True]),
        "set": {1, 2},
        "frozenset": frozenset({"x"}),
        "bytes": b"\x00\xff",
        "complex": 1 + 2j,
        "text": "surrogate \udcff kept",
        "ordered": OrderedDict(b=1, a=2),
        "counter": Counter("aab"),
        "tensor": torch.arange(4, dtype=torch.int64) * rank,
        "half": torch.ones(2, dtype=torch.bfloat16),
        "bool": torch.tensor([True, False]),
        "view": torch.arange(6.0).reshape(2, 3)[:, 1],
        "param": torch.nn.Parameter(torch.zeros(2)),
        "dtype": torch.float16,
        "device": torch.device("cpu"),
        "size": torch.Size([2, 3]),
    }


def test_plain_data_and_tensors_come_back_whole():
    results = launch(return_plain_data, 2)
    r = results[1]
    assert r["rank"] == 1 and r["floats"][1] == math.inf and math.copysign(1, r["floats"][2]) < 0
    assert r["nested"] == ({"a": (1, 2)}, [None, True]) and r["set"] == {1, 2}
    assert r["frozenset"] == frozenset({"x"}) and r["bytes"] == b"\x00\xff"
    assert r["complex"] == 1 + 2j and r["text"] == "surrogate \udcff kept"
    assert list(r["ordered"]) == ["b", "a"] and r["counter"] == Counter("aab")
    assert torch.equal(r["tensor"], torch.tensor([0, 1, 2, 3]))
    assert r["half"].dtype == torch.bfloat16 and r["bool"].tolist() == [True, False]
    assert r["view"].tolist() == [1.0, 4.0] and isinstance(r["param"], torch.nn.Parameter)
    assert (r["dtype"], r["device"], r["size"]) == (torch.float16, torch.device("cpu"), (2, 3))


def return_numpy():
    return np.ones(3)


def test_a_result_the_launcher_does_not_rebuild_names_itself_and_the_fix():
    with pytest.raises(RankError) as info:
        launch(return_numpy, 1)
    message = str(info.value)
    assert "rank 0 sent a result the launcher refused: its result needs numpy." in message
    assert ".tolist() or torch.from_numpy()" in message and "dataclasses.asdict()" in message


def raise_with_a_surrogate():
    raise ValueError("bad byte \udcff in a message")


def test_an_error_message_with_any_text_comes_back():
    with pytest.raises(RankError, match="bad byte \udcff in a message"):
        launch(raise_with_a_surrogate, 1)


def test_wire_refuses_what_is_not_a_message_and_logs_what_it_decodes(tmp_path, monkeypatch):
    garbage = wire.decode(b"not a message")
    assert isinstance(garbage, wire.RefusedMessage) and garbage.needs == ""
    log = tmp_path / "results.log"
    monkeypatch.setenv(wire.RESULTS_LOG_ENV, str(log))
    wire.decode(wire.encode(("ok", {"t": torch.ones(1)}, "gloo")), "lab (mod.fn)")
    refused = wire.decode(wire.encode(("ok", np.float64(1.0), "gloo")), "lab (mod.fn)")
    assert refused.needs.startswith("numpy")
    lines = log.read_text().splitlines()
    assert lines[0] == (
        "lab (mod.fn)\tcollections.OrderedDict torch.FloatStorage torch._utils._rebuild_tensor_v2"
    )
    assert lines[1].startswith("lab (mod.fn)\tREFUSED ") and "numpy.dtype" in lines[1]


# --- the parent's memory and descriptors ------------------------------------------------------
PEEK = textwrap.dedent(
    """
    import json, os, sys
    from labs import launch
    from labs.runtime import keep_from_ranks, protect_from_ranks

    def peek(fd):
        found = {}
        parent = os.getppid()
        for what, path, mode in (
            ("fd", f"/proc/{parent}/fd/{fd}", os.O_WRONLY),
            ("mem", f"/proc/{parent}/mem", os.O_RDONLY),
        ):
            try:
                os.close(os.open(path, mode))
                found[what] = "opened"
            except OSError as e:
                found[what] = type(e).__name__
        try:
            os.write(fd, b"rank")
            found["inherited fd"] = "written"
        except OSError as e:
            found["inherited fd"] = type(e).__name__
        found["secret"] = os.environ.get("LABS_TEST_SECRET")
        return found

    read_end, write_end = os.pipe()
    os.environ["LABS_TEST_SECRET"] = "token"
    before = launch(peek, 1, write_end)[0]
    assert protect_from_ranks()
    keep_from_ranks(fds=[write_end], env=["LABS_TEST_SECRET"])
    after = launch(peek, 1, write_end)[0]
    os.close(write_end)
    print(json.dumps({"before": before, "after": after, "pipe": os.read(read_end, 100).decode()}))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc are Linux's")
def test_a_forked_rank_cannot_reach_the_parents_memory_or_descriptors():
    command = [sys.executable, "-c", PEEK]
    if os.geteuid() == 0:  # root may ptrace anyone: run as root without CAP_SYS_PTRACE
        command = ["setpriv", "--bounding-set=-sys_ptrace", *command]
    env = {**os.environ, "LABS_START_METHOD": "fork"}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    # unprotected, a rank reaches all of it (its parent's memory too, unless Yama forbids a
    # child to attach to its parent): the test can fail
    yama = Path("/proc/sys/kernel/yama/ptrace_scope")
    mem = "PermissionError" if yama.exists() and yama.read_text().strip() != "0" else "opened"
    assert seen["before"] == {
        "fd": "opened",
        "mem": mem,
        "inherited fd": "written",
        "secret": "token",
    }
    assert seen["after"] == {
        "fd": "PermissionError",
        "mem": "PermissionError",
        "inherited fd": "OSError",  # EBADF: /dev/null, read-only, stands in its place
        "secret": None,
    }
    assert seen["pipe"] == "rank"  # the one write before keep_from_ranks, none after
