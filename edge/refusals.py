"""The answers a request gets when it is refused before it runs: 429 at once (never a waiting line) with the time to
come back, or 503 when what would count it cannot be reached.

Each says why in words a client can act on, and when to retry: ``retry-after-ms`` (what the openai SDK reads first)
and ``Retry-After`` in whole seconds, rounded up (every other client).  The lifecycle, the tenant gate's decisions and
the early refusal all answer through here, so a refusal reads the same whoever made it.
"""

from __future__ import annotations

import math

from edgepath.contract import wire
from edgepath.edge.http import HttpError
from edgepath.edge.tenancy.gate import CapReached, Refusal
from edgepath.edge.tenancy.quota import Refused, Unavailable
from edgepath.native.abi import Status


class Refusals:
    """Refusal answers; ``retry_after_s``: the ``Retry-After`` of one the agent has no estimate for."""

    def __init__(self, retry_after_s: int) -> None:
        self.retry_after_s = retry_after_s

    def no_slot(self, retry_ms: float = 0.0) -> HttpError:
        """429 at once: nothing is queued, the client retries -- when the agent predicts the first slot frees
        (``retry_ms``; 0: no estimate, the default ``Retry-After``)."""
        return self.retry_later("no_slot", "every slot is busy; this server does not queue requests", retry_ms)

    def busy(self) -> HttpError:
        """429 at once when every tokenizer worker is busy with a large prompt, or the request's tenant holds its
        share of them: no waiting line."""
        return self.retry_later(
            "tokenizer_busy",
            "every tokenizer worker this API key may use is busy with a large prompt; this server does not queue",
            0.0,
        )

    def over_bound(self, wait_ms: float, bound_ms: float, retry_ms: float) -> HttpError:
        """429 at once: every slot server's predicted wait for a first token is over the request's bound;
        ``retry_ms``: when the agent predicts the wait will be back within it."""
        return self.retry_later(
            "over_bound",
            f"the predicted wait for a first token is {wait_ms / 1e3:.2f} s, over this request's bound of "
            f"{bound_ms / 1e3:.2f} s (X-Max-Wait, at most the server's); this server does not queue requests",
            retry_ms,
        )

    def over_cap(self, cap: int, retry_ms: float = 0.0, everywhere: bool = False) -> HttpError:
        """429 ``slot_cap`` at once: the tenant already has ``cap`` requests in flight at this edge, or holds ``cap``
        slots across every edge (``everywhere``: the agent counted them), its most."""
        where = "slots across every edge" if everywhere else "requests in flight at this edge"
        return self.retry_later("slot_cap", f"this API key's tenant holds {cap} {where}, its slot_cap", retry_ms)

    def over_quota(self, refused: Refused) -> HttpError:
        """429 ``quota_exceeded`` at once, before any work: the request's prompt and ``max_tokens`` (or the request
        itself) do not fit what is left of its tenant's quota; ``retry-after-ms`` says when enough will have
        refilled (none when the request alone is more than the whole quota: it never fits)."""
        unit, limit, window = refused.unit, refused.limit, refused.window
        if unit == "requests":
            need = "this request is 1 request"
        elif refused.least:
            need = f"any request takes at least {refused.need} tokens (a token of prompt and one of answer)"
        else:
            need = f"this request needs {refused.need} tokens (its prompt and max_tokens)"
        if math.isinf(refused.retry_after):
            why = f"{need}, more than the whole {limit}-token quota per {window}: lower max_tokens"
            return HttpError(429, "quota_exceeded", why)
        quota = f"{limit}-{unit[:-1]} quota per {window}"
        why = f"{need}; {refused.remaining} of the {quota} {'is' if refused.remaining == 1 else 'are'} left"
        return self.retry_later("quota_exceeded", why, max(1.0, refused.retry_after * 1e3))

    def quota_unavailable(self, why: str) -> HttpError:
        """503 ``quota_unavailable`` at once: the tenant has a quota and the ledger that counts it cannot be reached
        -- quotas fail closed (nothing is served uncounted); ``Retry-After`` the default."""
        return HttpError(
            503,
            "quota_unavailable",
            f"this API key's tenant has a quota and its ledger cannot be reached ({why}); retry later",
            [(b"retry-after", str(self.retry_after_s).encode())],
        )

    def waiting(self) -> HttpError:
        """429 at once: the request's tenant already has its large requests waiting for their turn to be read
        (edge/turns.py), so this one is not read at all."""
        return self.retry_later(
            "large_requests_waiting",
            "this API key already has its large requests waiting to be read; this server does not queue more",
            0.0,
        )

    def body_rate(self, retry_s: float, rate: int) -> HttpError:
        """429 from the headers: the request's tenant has had its budget of body bytes read (``rate`` a second:
        edge/body_budget.py), so this body is not read at all; ``retry_s``: when the budget holds it."""
        return self.retry_later(
            "body_rate",
            f"this API key's tenant sends request bodies faster than this edge reads them for one tenant ({rate} "
            "bytes a second, --body-rate); this one was not read",
            max(1.0, retry_s * 1e3),
        )

    def overloaded(self, used: int, limit: int) -> HttpError:
        """503 at once: the edge's memory is over its high-water mark (edge/overload.py), so new work is shed until
        it is back under; the requests under way go on."""
        return HttpError(
            503,
            "overloaded",
            f"this edge uses {used >> 20} MiB of its {limit >> 20} MiB memory limit and sheds new requests until it "
            "is back under its high-water mark; retry later (or on another edge)",
            [(b"retry-after", str(self.retry_after_s).encode())],
        )

    def retry_later(self, type_: str, why: str, retry_ms: float) -> HttpError:
        """A 429 that says when to come back (``retry_ms``; 0: no estimate, the default ``Retry-After``)."""
        if retry_ms > 0:
            ms = math.ceil(retry_ms)
            headers = [(b"retry-after-ms", str(ms).encode()), (b"retry-after", str(math.ceil(ms / 1e3)).encode())]
        else:
            headers = [(b"retry-after", str(self.retry_after_s).encode())]
        return HttpError(429, type_, f"{why}, retry later", headers)

    def tenant(self, refusal: Refusal) -> HttpError:
        """The answer to a request its tenant gate refused (:mod:`edgepath.edge.tenancy.gate`)."""
        if isinstance(refusal, CapReached):
            return self.over_cap(refusal.cap)
        if isinstance(refusal, Unavailable):
            return self.quota_unavailable(refusal.why)
        return self.over_quota(refusal)

    def data_path(self, status: Status, result: wire.ResultHeader, cap: int = 0) -> HttpError:
        """The answer to a request the data path refused before any slot ran it (``result``: its frame's result
        header, which says when to come back, the bound and, for OVER_BOUND, the least predicted wait; ``cap``: its
        tenant's slot cap, which the agent counts across every edge -- SLOT_CAP, docs/TENANTS.md)."""
        if status == Status.NO_SLOT:
            return self.no_slot(result.retry_after_ms)
        if status == Status.SLOT_CAP:
            return self.over_cap(cap, result.retry_after_ms, everywhere=True)
        if status == Status.OVER_BOUND:
            return self.over_bound(result.refusal_wait_us / 1e3, result.refusal_bound_ms, result.retry_after_ms)
        if status == Status.UNAVAILABLE:
            return HttpError(503, "unavailable", "no slot server is reachable")
        return HttpError(400, "bad_request", "the data path refused this request")
