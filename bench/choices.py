"""What ``n`` choices cost in prefill: a ~500-token prompt asked with ``n=1`` and with ``n=N`` against a running
``serve`` (HTTP/1.1), alternately in one run, each request with a ``cache_salt`` of its own so no request reuses
another's prompt.  Each request is streamed with ``max_tokens: 1``; its time is from sending to the first content
chunk of its **last** choice -- when all n choices have their first token.  ``n`` shares its one prefill through the
slot server's prefix cache (the first placed computes the prompt, the others copy its KV), so the ratio of the
medians is the price of the other choices.

``python -m edgepath.bench.choices --port 8080 --model NAME [--n 4] [--rounds 5]`` prints one JSON line.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import time
from collections.abc import Sequence

#: 500 tokens with SmolLM2's tokenizer
PROMPT = " ".join(f"item {i} is a {('red', 'green', 'blue', 'small')[i % 4]} box" for i in range(63))


def first_tokens_s(port: int, model: str, n: int, salt: str) -> tuple[float, int]:
    """Seconds until every one of ``n`` choices streamed its first content, and the prompt's tokens."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "n": n,
        "max_tokens": 1,
        "temperature": 0.8,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_salt": salt,
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        started = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"n={n}: HTTP {response.status}: {response.read()[:300]!r}")
        seen: set[int] = set()
        last = 0.0
        prompt = 0
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            doc = json.loads(line[6:])
            for choice in doc["choices"]:
                if choice["index"] not in seen:
                    seen.add(choice["index"])
                    last = time.perf_counter() - started
            if doc.get("usage"):
                prompt = doc["usage"]["prompt_tokens"]
        if len(seen) != n:
            raise RuntimeError(f"n={n}: {len(seen)} choices answered")
        return last, prompt
    finally:
        conn.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help="a running serve --transport tcp")
    parser.add_argument("--model", required=True, help="the served model's name")
    parser.add_argument("--n", type=int, default=4, help="choices of the compared request (default 4)")
    parser.add_argument("--rounds", type=int, default=5, help="requests of each kind, alternated (default 5)")
    args = parser.parse_args(argv)
    first_tokens_s(args.port, args.model, 1, "warm-up")
    one, many = [], []
    prompt = 0
    for r in range(args.rounds):
        t, prompt = first_tokens_s(args.port, args.model, 1, f"one-{r}-{time.time_ns()}")
        one.append(t)
        many.append(first_tokens_s(args.port, args.model, args.n, f"many-{r}-{time.time_ns()}")[0])
    report = {
        "prompt_tokens": prompt,
        "n": args.n,
        "rounds": args.rounds,
        "n1_s": [round(t, 4) for t in one],
        f"n{args.n}_s": [round(t, 4) for t in many],
        "ratio_of_medians": round(statistics.median(many) / statistics.median(one), 3),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
