"""Hung is not dead: ``edgepath serve`` notices a frozen slot server within its hang timeout, refuses at once
while it is frozen, ends what it held at detection, and replaces it -- nothing lost, nothing answered twice.

A freeze is made the way a stuck GPU kernel or a wedged driver looks from outside: SIGSTOP of the slot-server
child (its memory still answers the agent's reads and CAS, nothing comes back), or a handler that blocks in
the slot server's loop.  The tests wait for states (/health, the child's pid, answers), never for a fixed time;
the few bounds they check are the promises themselves (detection within the hang timeout, refusals well under
a second, in-flight requests ended at detection rather than at --request-timeout)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers.hang import HANG_ON
from helpers.supervised import Answer, Load, get, metric, slot_server_of, start_serve_tcp
from helpers.waiting import wait_for

from edgepath.children import Child

pytestmark = pytest.mark.slow  # multi-process: edgepath serve with its slot-server child

HANG = 1.5  # --hang-timeout of these tests: seconds (the soft-RoCE lane's emulated VM gets a longer one)
HANG_VERBS = 4.0
REQUEST_TIMEOUT = 60  # --request-timeout: far from every bound checked here
CHILD_START = 120.0  # seconds a child process may take to start: the emulated VM of the soft-RoCE lane is slow
TESTS = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Hugging Face tokenizer.json with the load's few words: it loads at once, where the default 131k-word
    vocabulary takes a minute to load in the soft-RoCE lane's emulated VM."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "worker": 1, "request": 2, **{str(i): 3 + i for i in range(4000)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


@pytest.fixture
def serve_hangable(
    edgepath_process: Callable[..., Child],
    transport_cli_args: list[str],
    new_address: Callable[[str], str],
    word_tokenizer: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Callable[..., tuple[Child, int]]]:
    """``edgepath serve --transport tcp`` over the chosen data path with a short hang timeout."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))

    def start(*handler: str, hang: float = HANG) -> tuple[Child, int]:
        return start_serve_tcp(
            edgepath_process,
            *handler,
            "--hang-timeout",
            str(hang),
            "--request-timeout",
            str(REQUEST_TIMEOUT),
            "--slot-server-listen",
            new_address("slot-server"),
            "--tokenizer",
            word_tokenizer,
            *transport_cli_args,
            timeout=CHILD_START,
        )

    yield start


PACED = ("--handler", "paced-echo", "--handler-option", "token_delay=0.03")


def freeze(pid: int) -> float:
    os.kill(pid, signal.SIGSTOP)
    return time.monotonic()


def thaw(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # killed (and replaced) already
        os.kill(pid, signal.SIGCONT)


def first_503(port: int) -> tuple[float, dict]:
    """Poll /health until it answers 503: when, and what it said."""
    seen: list[tuple[float, dict]] = []

    def down() -> bool:
        status, doc = get(port, "/health")
        if status == 503:
            seen.append((time.monotonic(), doc))
        return bool(seen)

    wait_for(down, 30, "/health to report the frozen slot server")
    return seen[0]


@pytest.fixture
def hang(transport_name: str) -> float:
    """The hang timeout of the transport-marked test: the emulated VM of the soft-RoCE lane runs everything
    several times slower (an idle server's 50 ms beat included), so it gets more room."""
    return HANG_VERBS if transport_name == "verbs" else HANG


@pytest.mark.transport
def test_a_frozen_slot_server_is_reported_refused_at_once_ended_at_detection_and_replaced(
    serve_hangable, hang: float
) -> None:
    serve, port = serve_hangable(*PACED, hang=hang)
    frozen = slot_server_of(serve)
    assert frozen is not None
    with Load(port) as load:
        wait_for(lambda: len(load.oks_after(0.0)) >= 10, 60, "steady 200s before the freeze")
        frozen_at = freeze(frozen)
        try:
            detected, health = first_503(port)
            assert health["status"] == "unresponsive" and "no heartbeat for" in health["reason"], health
            assert get(port, "/health/live")[0] == 200  # the edge lives: only readiness goes
            wait_for(lambda: slot_server_of(serve) not in (None, frozen), 30, "serve to replace the hung child")
            replaced = time.monotonic()
            # a process start takes 12-30 s in the soft-RoCE lane's emulated VM (seen in CI: 30 s, loaded)
            wait_for(lambda: get(port, "/health/ready")[0] == 200, CHILD_START, "the new slot server to be ready")
            wait_for(lambda: bool(load.oks_after(replaced)), 30, "200s from the new slot server")
        finally:
            thaw(frozen)
    answers = load.answers
    assert all(a.status in (200, 503, 504) for a in answers), {a.status for a in answers}  # one answer each
    # what the frozen server held: in flight at the freeze.  (Not "at detection": `detected` is when a /health
    # poll saw the verdict, which on a loaded machine can come after the edge had already ended them.)
    held = [a for a in answers if a.sent < frozen_at < a.answered]
    refused = [a for a in answers if detected < a.sent and a.answered < replaced and a.status == 503]
    assert detected - frozen_at <= hang + 0.5, f"/health said so {detected - frozen_at:.2f} s after the freeze"
    assert held and all(a.status in (200, 504) for a in held), held
    ended_at_detection = [a.answered - detected for a in held if a.status == 504]
    assert ended_at_detection and max(ended_at_detection) < 1.0, ended_at_detection  # not at --request-timeout
    assert refused and max(a.answered - a.sent for a in refused) < 1.0, _slowest(refused)
    assert metric(port, "edgepath_slot_server_hangs_total") == 1.0
    assert metric(port, "edgepath_port_duplicates_total") == 0.0 and metric(port, "edgepath_port_unknown_total") == 0.0
    log = serve.stderr_tail()
    assert (
        f"slot server (pid {frozen}) is hung" in log and f"pid {frozen} killed by signal SIGKILL, by serve: hung" in log
    )


def _slowest(answers: list[Answer]) -> list[tuple[float, str]]:
    return sorted(((a.answered - a.sent, a.detail) for a in answers), reverse=True)[:3]


def test_a_slot_server_that_thaws_in_time_serves_on_and_answers_nothing_twice(serve_hangable) -> None:
    """Frozen past one hang timeout but not two: refused meanwhile, then the same process serves again;
    what it held was answered 504 at detection, and its late results are fenced (counted late, not sent)."""
    serve, port = serve_hangable(*PACED, hang=3.0)
    frozen = slot_server_of(serve)
    assert frozen is not None
    with Load(port) as load:
        wait_for(lambda: len(load.oks_after(0.0)) >= 10, 60, "steady 200s before the freeze")
        freeze(frozen)
        try:
            first_503(port)
            # what it held is answered 504 when the edge takes the verdict, a moment after /health shows it:
            # thawed before that, the server would answer those requests itself
            wait_for(lambda: any(a.status == 504 for a in load.answers), 30, "the held requests' 504s")
        finally:
            thaw(frozen)
        wait_for(lambda: get(port, "/health/ready")[0] == 200, 30, "the thawed server to be ready again")
        thawed = time.monotonic()
        wait_for(lambda: len(load.oks_after(thawed)) >= 5, 30, "200s after the thaw")
    assert slot_server_of(serve) == frozen  # not killed: it came back within the second hang timeout
    assert all(a.status in (200, 503, 504) for a in load.answers), {a.status for a in load.answers}
    assert metric(port, "edgepath_port_late_total") >= 1.0  # what it held came back, and was not delivered
    assert metric(port, "edgepath_port_duplicates_total") == 0.0 and metric(port, "edgepath_port_unknown_total") == 0.0
    assert metric(port, "edgepath_slot_server_hangs_total") == 0.0


def test_a_handler_that_blocks_is_replaced_and_its_request_ends_504(serve_hangable) -> None:
    serve, port = serve_hangable("--handler", "helpers.hang:echo_unless_13")
    stuck = slot_server_of(serve)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    sent = time.monotonic()
    try:
        conn.request("POST", "/v1/generate", body=json.dumps({"tokens": [1, 2, 3], "max_tokens": HANG_ON}))
        response = conn.getresponse()
        doc = json.loads(response.read())
    finally:
        conn.close()
    assert response.status == 504 and doc["error"]["type"] == "unresponsive", doc
    assert time.monotonic() - sent < REQUEST_TIMEOUT / 2  # ended by the heartbeat, not by the request timeout
    wait_for(lambda: slot_server_of(serve) not in (None, stuck), 30, "serve to replace the hung child")
    wait_for(lambda: get(port, "/health")[0] == 200, 30, "/health to be ok again")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/v1/generate", body=json.dumps({"tokens": [1, 2, 3], "max_tokens": 3}))
        assert json.loads(conn.getresponse().read())["tokens"] == [1, 2, 3]
    finally:
        conn.close()


def post(port: int, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/generate", body=json.dumps(body))
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_with_every_slot_held_a_stopped_slot_server_still_gets_its_429s_at_once(serve_hangable) -> None:
    """The 429 path awaits nothing from the slot server: with every slot held by a long request and the
    server stopped (SIGSTOP, well inside its hang timeout), a new request is still answered 429 -- while the
    server can answer nothing at all.  Admission is the agent's CAS on the pool's memory."""
    serve, port = serve_hangable("--handler", "paced-echo", "--handler-option", "token_delay=0.25", hang=60.0)
    held = list(range(1, 21))  # 20 tokens, one every 0.25 s: each request holds its slot for about 5 s
    with ThreadPoolExecutor(4) as pool:
        holders = [pool.submit(post, port, {"tokens": held, "max_tokens": 20}) for _ in range(4)]
        wait_for(lambda: get(port, "/health")[1]["free_slots"] == 0, 30, "every slot to be held")
        stopped = slot_server_of(serve)
        assert stopped is not None
        freeze(stopped)
        try:
            status, doc = post(port, {"tokens": [1], "max_tokens": 1})
        finally:
            thaw(stopped)
        assert status == 429 and doc["error"]["type"] == "no_slot", doc
        assert [f.result()[0] for f in holders] == [200] * 4  # the held ones finish once it runs again
    assert slot_server_of(serve) == stopped
