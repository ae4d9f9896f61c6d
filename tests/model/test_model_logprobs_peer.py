"""edgepath's log probabilities against llama.cpp's own ``llama-server`` (built from the llama.cpp edgepath runs,
as ``edgepath bench model`` builds it): the same GGUF and prompt ids give the same greedy tokens, the same
likeliest alternatives and log probabilities within :data:`TOLERANCE`."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.edge import RunningEdge, free_port, running_edge

from edgepath.config import AgentSettings, EdgeSettings, HandlerSettings, ServeOptions, Sizing

pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")
openai = pytest.importorskip("openai", reason="the openai client is in the test extras")
llama_server = pytest.importorskip("edgepath.bench.llama_server", reason="the benchmarks are not installed")
pytestmark = pytest.mark.slow  # two model servers

#: most a log probability may differ from llama-server's, in nats: both run the same llama.cpp kernels on the same
#: weights, but a prompt computed in other steps gives logits within the batch tolerance (docs/MODEL.md), and
#: llama-server computes its probabilities in float32 where edgepath uses float64
TOLERANCE = 0.1
TOP = 5
TOKENS = 5  # a slot of 64 output words holds 5 tokens with 5 alternatives (12 words each)
PROMPT = "The three primary colours are red, yellow and"


@pytest.fixture(scope="module")
def gguf() -> str:
    from edgepath.model.gguf import default_model_path

    return str(default_model_path())


@pytest.fixture(scope="module")
def edge(gguf: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEdge]:
    options = ServeOptions(
        edge=EdgeSettings(transport="tcp", port_asked=free_port(kind=socket.SOCK_STREAM), tokenizer=gguf),
        sizing=Sizing(slots=1, input_capacity=128, output_capacity=64),
        agent=AgentSettings(frames=4),
        handler=HandlerSettings("llama", (("model", gguf), ("threads", "1"))),
    )
    with running_edge(options, tmp_path_factory.mktemp("edge"), timeout=120.0) as running:
        yield running


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def peer(gguf: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    built = llama_server.find()
    if built is None:
        pytest.skip(f"llama-server is not built: `{llama_server.BUILD_COMMAND}`")
    port = free_port(kind=socket.SOCK_STREAM)
    log = (tmp_path_factory.mktemp("peer") / "llama-server.log").open("w")
    argv = [str(built.server), "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", "1", "-c", "256"]
    proc = subprocess.Popen([*argv, "-t", "1", "-tb", "1"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"llama-server did not start: see {Path(log.name)}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_logprobs_equal_llama_servers_within_the_tolerance(edge: RunningEdge, peer: str) -> None:
    ids = _post(f"{peer}/tokenize", {"content": PROMPT})["tokens"]
    theirs = _post(
        f"{peer}/completion",
        {"prompt": ids, "n_predict": TOKENS, "temperature": 0, "n_probs": TOP, "cache_prompt": False},
    )["completion_probabilities"]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{edge.port}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    ours = client.completions.create(model=model, prompt=ids, max_tokens=TOKENS, temperature=0, logprobs=TOP)
    logprobs = ours.choices[0].logprobs
    assert len(theirs) == len(logprobs.tokens) == TOKENS
    worst = 0.0
    for position, (peer_entry, token, logprob, top) in enumerate(
        zip(theirs, logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True)
    ):
        assert token == peer_entry["token"], f"position {position}: {token!r} against llama-server's"
        peer_top = {alt["token"]: alt["logprob"] for alt in peer_entry["top_logprobs"]}
        # near-ties may rank the other way: the k-th likeliest values agree rank by rank, and so does every
        # alternative both list
        ranked = zip(top.values(), sorted(peer_top.values(), reverse=True), strict=False)
        common = [(top[t], peer_top[t]) for t in top if t in peer_top]
        assert len(common) >= TOP - 1, f"position {position}: {list(top)} against llama-server's {list(peer_top)}"
        for a, b in [(logprob, peer_entry["logprob"]), *ranked, *common]:
            worst = max(worst, abs(a - b))
    assert worst <= TOLERANCE, f"largest difference {worst:.4f} nats"
    print(f"largest log-probability difference from llama-server: {worst:.4f} nats")
