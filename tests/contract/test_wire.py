"""The wire contract owns every encoding: header views, connection data, immediates, the status region."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from edgepath.contract import wire
from edgepath.contract.pool import FrameArray, FrameLayout
from edgepath.native.abi import REQUEST_HEADER, RESULT_HEADER, State, Status, ffi

ROOT = Path(__file__).resolve().parents[2]


def test_header_views_declare_exactly_the_c_fields() -> None:
    for view, dtype in ((wire.RequestHeader, REQUEST_HEADER), (wire.ResultHeader, RESULT_HEADER)):
        scalar = [name for name in dtype.names if dtype.fields[name][0].shape == ()]
        assert list(view.__annotations__) == scalar

    with pytest.raises(TypeError, match=r"struct ep_result_header \(native/edgepath_slot.h\) has"):

        class Short(wire.StructView, struct="ep_result_header"):
            request_id: int


def test_views_read_and_write_the_frame_memory_in_place() -> None:
    layout = FrameLayout(8, 4)
    frames = FrameArray(np.zeros(2 * layout.stride, dtype=np.uint8), 0, 2, layout)
    req, res = frames.request_headers[1], frames.result_headers[1]
    zeroed = wire.Sampling(0.0, 0.0, 0, 0, repetition_penalty=0.0)  # a zeroed header: greedy, no cut, no penalty
    assert req.sampling() == zeroed and not zeroed.shaped
    sampling = wire.Sampling(0.5, 0.9, 40, 7)
    req.fill(11, 3, 4, wire.FLAG_STREAM, sampling, 100, 200)
    req.stamp(2**32 + 5, 3, 1)  # the generation is the word's 32 bits
    row = frames.requests[1]
    assert (int(row["request_id"]), int(row["token_count"]), int(row["generation"])) == (11, 3, 5)
    assert (int(row["max_new_tokens"]), int(row["flags"])) == (4, wire.FLAG_STREAM)
    assert (int(row["t_receive_ns"]), int(row["t_tokenized_ns"])) == (100, 200) and int(row["t_written_ns"]) > 0
    assert int(row["doorbell"]) == wire.doorbell_word(3, 5) and int(row["reply_index"]) == 1
    assert req.sampling() == wire.Sampling(0.5, pytest.approx(0.9), 40, 7)
    assert req.streaming(0.002) == 0.002
    row["stream_window_us"] = 500
    assert req.streaming(0.002) == 0.0005
    row["flags"] = 0
    assert req.streaming(0.002) is None

    res.begin(11, 5, 3)
    assert (res.request_id, res.generation, res.slot, res.t_first_ns) == (11, 5, 3, 0) and res.t_start_ns > 0
    assert res.placed_for(5) == 0 and res.placed_for(4) is None
    res.placed(5, 2)
    assert int(frames.results[1]["progress"]) == wire.progress_word(5, 2) and res.placed_for(5) == 2
    res.end(5, Status.LENGTH, 4)
    out = frames.results[1]
    assert (int(out["status"]), int(out["output_count"])) == (Status.LENGTH, 4)
    assert int(out["t_done_ns"]) >= int(out["t_start_ns"]) > 0
    assert res.placed_for(5) == 4
    res.refuse(Status.NO_SLOT)
    assert (res.status, res.output_count) == (Status.NO_SLOT, 0)
    assert frames.requests[0]["request_id"] == 0 and frames.results[0]["status"] == 0  # the other frame untouched


def test_claim_next_is_claim_word_without_the_exception() -> None:
    free = wire.free_word(9)
    assert wire.claim_next(free, 3) == wire.claim_word(free, 3)
    claimed = wire.claim_word(free, 3)
    assert wire.claim_next(claimed, 4) == 0
    with pytest.raises(wire.TransitionRefused):
        wire.claim_word(claimed, 4)
    words = np.array([free, claimed, wire.free_word(1)], dtype=np.uint64)
    assert wire.in_state(words, State.FREE).tolist() == [True, False, True]
    assert wire.in_state(words, State.CLAIMED).tolist() == [False, True, False]


def test_agent_hello_round_trips_and_names_what_is_missing() -> None:
    hello = wire.AgentHello(4, 16, 8, 128)
    assert wire.AgentHello.parse(hello.info()) == hello
    assert wire.AgentHello.parse({"frames": 2, "input_capacity": 1, "output_capacity": 1}).replies_offset == 0
    with pytest.raises(wire.InfoInvalid, match="missing 'frames'"):
        wire.AgentHello.parse({"input_capacity": 1, "output_capacity": 1})
    with pytest.raises(wire.InfoInvalid, match="not an integer"):
        wire.AgentHello.parse({**hello.info(), "frames": "many"})


def test_edge_grant_and_hello() -> None:
    info = {**wire.EdgeGrant.capacities(16, 8), **wire.EdgeGrant.frames(32, 16)}
    assert wire.EdgeGrant.parse(info) == wire.EdgeGrant(16, 8, 32, 16)
    info = {**wire.EdgeGrant.capacities(16, 8, ["a.sock", "b.sock"]), **wire.EdgeGrant.frames(0, 4)}
    assert wire.EdgeGrant.parse(info).slot_servers == ("a.sock", "b.sock")
    with pytest.raises(wire.InfoInvalid, match="'slot_servers' must be a list of addresses"):
        wire.EdgeGrant.parse({**info, wire.SLOT_SERVERS: "a.sock"})
    assert wire.is_edge_hello(wire.edge_hello()) and not wire.is_edge_hello({"frames": 1})


@pytest.mark.parametrize("index", [0, 1, 255, wire.IMM_INDEX_MASK])
def test_edge_immediates_round_trip(index: int) -> None:
    submit, cancel = wire.submit_imm(index), wire.edge_cancel_imm(index)
    assert (wire.edge_imm_frame(submit), wire.is_cancel_imm(submit)) == (index, False)
    assert (wire.edge_imm_frame(cancel), wire.is_cancel_imm(cancel)) == (index, True)
    assert submit < 2**32 and cancel < 2**32


def test_doorbell_entry_carries_the_connection_and_the_immediate() -> None:
    imm = wire.doorbell_imm(7, 2**20 + 3)
    entry = wire.doorbell_entry(12, imm)
    assert (entry >> 32, entry & 0xFFFFFFFF) == (12, imm)


def test_agent_status_publishes_and_reads_in_place() -> None:
    buf = np.zeros(wire.STATUS_BYTES, dtype=np.uint8)
    writer, reader = wire.AgentStatus(buf), wire.AgentStatus(buf)
    writer.publish(3, 8, True)
    assert reader.read() == (3, 8, True)
    assert reader.links() == []
    writer.publish(0, 8, False, [(1, 0, 5, 6, 7), (2, 1, 8, 9, 10)])
    assert reader.read() == (0, 8, False)
    assert reader.links() == [(1, 0, 5, 6, 7), (2, 1, 8, 9, 10)]
    with pytest.raises(ValueError, match=f"status region holds {wire.STATUS_LINKS} links"):
        writer.publish(0, 8, False, [(0,) * wire.LINK_WORDS] * (wire.STATUS_LINKS + 1))
    with pytest.raises(ValueError, match=f"status region needs {wire.STATUS_BYTES} bytes"):
        wire.AgentStatus(np.zeros(8, dtype=np.uint8))


def test_views_are_as_cheap_as_the_pointer_for_reads() -> None:
    """A field read goes straight through the cffi pointer (operator.attrgetter), no Python frame."""
    view = wire.ResultHeader(ffi.new("struct ep_result_header *"))
    prop = type(view).__dict__["output_count"]
    assert type(prop.fget).__name__ == "attrgetter"


# -- the done criterion of issue 22: nothing outside contract/wire/ knows a slot word's bit layout ----------
#: a mask, a shift by a field width, the state machine's raw step, or a raw view of the status words
ENCODING = re.compile(r"STATE_MASK|ep_step_word|\bIMM_[A-Z_]+|<<\s*(8|16|32)\b|>>\s*(8|16|32)\b|&\s*0x[fF]+\b|\[:24\]")
#: the transports' own immediates (32 bits), completion and handshake encodings (connection << 32 | immediate,
#: a length | state control word): below the wire contract, not slot words
TRANSPORT_INTERNALS = {
    "transports/base.py",
    "transports/loopback.py",
    "transports/verbs_datapath.py",
    "transports/verbs_setup.py",
}


def _encodings_outside_wire() -> list[str]:
    found = []
    for folder in ("transports", "contract", "slots", "dpu", "edge", "model", "edgepath", "native", "options"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel.startswith("contract/wire/") or rel in TRANSPORT_INTERNALS:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if ENCODING.search(code) and '"""' not in code and "``" not in code:
                    found.append(f"{rel}:{number}: {line.strip()}")
    return found


def test_at_most_two_slot_word_encodings_outside_the_wire_contract() -> None:
    found = _encodings_outside_wire()
    assert len(found) <= 2, "\n".join(found)


def test_the_encoding_search_finds_what_it_looks_for() -> None:
    hits = [
        line
        for line in ("w & STATE_MASK", "conn << 32 | imm", "lib.ep_step_word(w)", "x & 0xFFFF", "buf[:24].view(u64)")
        if ENCODING.search(line)
    ]
    assert len(hits) == 5
    assert not ENCODING.search("limit = 1 << 20")


@pytest.mark.parametrize("index", [0, 1, 255, wire.IMM_INDEX_MASK])
def test_answers_towards_an_edge_say_their_kind_and_frame(index: int) -> None:
    final, progress, stalled = wire.final_imm(index), wire.progress_imm(index), wire.stalled_imm(index)
    assert [wire.imm_index(imm) for imm in (final, progress, stalled)] == [index] * 3
    assert [wire.is_progress_imm(imm) for imm in (final, progress, stalled)] == [False, True, False]
    assert [wire.is_stalled_imm(imm) for imm in (final, progress, stalled)] == [False, False, True]
    assert max(final, progress, stalled) < 2**32


# -- log probabilities in the output area ---------------------------------------------------------------


@pytest.mark.parametrize("top", [0, 1, 5, wire.TOP_LOGPROBS_MAX])
def test_logprob_records_round_trip_through_the_output_area(top: int) -> None:
    """What the model side writes is what the edge reads: ids exactly, log probabilities as float32, and the
    flags say how wide each record is (the stream flag beside them untouched)."""
    flags = wire.logprobs_flags(top) | wire.FLAG_STREAM
    assert wire.logprobs_top(flags) == top and flags & wire.FLAG_STREAM
    width = wire.record_words(top)
    rng = np.random.default_rng(top)
    n = 7
    ids = rng.integers(0, 2**31 - 1, n)
    logprobs = -rng.random(n).astype(np.float32) * 30
    alternatives = rng.integers(0, 2**31 - 1, (n, top))
    theirs = np.sort(-rng.random((n, top)).astype(np.float32) * 30, axis=1)[:, ::-1]
    out = np.full(n * width + 3, -1, dtype=np.int32)  # what follows the records is not touched
    for i in range(n):
        wire.write_record(out, i, int(ids[i]), float(logprobs[i]), alternatives[i], theirs[i])
    records = wire.read_records(out[: n * width], top)
    assert records.ids.tolist() == ids.tolist() and records.top_ids.tolist() == alternatives.tolist()
    assert records.logprobs.tobytes() == logprobs.tobytes() and records.top_logprobs.tobytes() == theirs.tobytes()
    assert out[n * width :].tolist() == [-1, -1, -1]
    with pytest.raises(ValueError, match="whole number"):
        wire.read_records(out[: n * width - 1], top)


def test_plain_output_and_bad_widths() -> None:
    assert wire.logprobs_top(wire.FLAG_STREAM) is None and wire.logprobs_top(0) is None
    assert wire.record_words(None) == 1 and wire.record_words(0) == 2 and wire.record_words(20) == 42
    for bad in (-1, wire.TOP_LOGPROBS_MAX + 1):
        with pytest.raises(wire.RequestInvalid, match="between 0 and 20"):
            wire.logprobs_flags(bad)


# -- a constraint after the prompt ----------------------------------------------------------------------


@pytest.mark.parametrize("grammar", ['root ::= "a"', 'root ::= "東京" | "🚀"\n', "x" * 4096])
def test_a_constraint_round_trips_in_the_words_after_the_prompt(grammar: str) -> None:
    words = wire.constraint_encoding(grammar)
    assert words.dtype == np.int32 and len(words) == -(-len(grammar.encode()) // 4)
    flags = wire.constraint_flags(len(words)) | wire.FLAG_STREAM | wire.logprobs_flags(3)
    assert wire.constraint_words(flags) == len(words) and wire.logprobs_top(flags) == 3  # beside each other
    assert wire.input_words(10, flags) == 10 + len(words) and wire.input_words(10, wire.FLAG_STREAM) == 10
    area = np.zeros(10 + len(words) + 2, dtype=np.int32)
    area[10 : 10 + len(words)] = words
    assert wire.read_constraint(area[10 : 10 + wire.constraint_words(flags)]) == grammar


def test_constraints_of_no_size_or_too_large_are_refused() -> None:
    with pytest.raises(wire.RequestInvalid, match="1 to 65535 words"):
        wire.constraint_encoding("")
    with pytest.raises(wire.RequestInvalid, match="1 to 65535 words"):
        wire.constraint_encoding("x" * 4 * 65536)
    with pytest.raises(wire.RequestInvalid, match="1 to 65535 words"):
        wire.constraint_flags(0)
    with pytest.raises(ValueError):
        wire.read_constraint(np.array([-1], dtype=np.int32))  # not UTF-8


def test_the_third_header_line_carries_min_p_the_penalties_and_the_bias_count() -> None:
    layout = FrameLayout(8, 4)
    frames = FrameArray(np.zeros(layout.stride, dtype=np.uint8), 0, 1, layout)
    req = frames.request_headers[0]
    bias = ((3, -100.0), (7, 2.5))
    sampling = wire.Sampling(0.5, 1.0, 0, 9, 0.25, 0.5, -1.0, 1.25, bias)  # all exact in float32
    req.fill(1, 3, 4, 0, sampling, 0, 0)
    row = frames.requests[0]
    assert int(row["logit_biases"]) == 2  # the pairs themselves follow the prompt
    assert req.sampling(bias) == sampling
    req.fill(2, 3, 4, 0, wire.Sampling(), 0, 0)  # a frame reused: nothing of the last request's sampling is left
    assert (float(row["min_p"]), float(row["presence_penalty"]), int(row["logit_biases"])) == (0.0, 0.0, 0)
    assert float(row["repetition_penalty"]) == 1.0 and not req.sampling().shaped


def test_logit_biases_follow_the_grammar_after_the_prompt_and_read_back() -> None:
    bias = ((5, -100.0), (40_000, 0.25))
    for grammar in ('root ::= "a"', None):
        words = wire.after_prompt(grammar, bias)
        assert words is not None and len(words) == (0 if grammar is None else 3) + 4
        assert wire.read_after_prompt(words, len(bias)) == (grammar, bias)
    assert wire.after_prompt(None, ()) is None
    assert wire.read_after_prompt(wire.after_prompt('root ::= "a"', ()), 0) == ('root ::= "a"', ())
    with pytest.raises(ValueError, match="3 logit biases take 6 words; 4 follow the prompt"):
        wire.read_after_prompt(wire.after_prompt(None, bias), 3)
    with pytest.raises(ValueError, match="its grammar is not UTF-8"):
        wire.read_after_prompt(np.array([-1, 5, 0], dtype=np.int32), 1)


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        (wire.Sampling(min_p=1.5), "min_p must be between 0 and 1"),
        (wire.Sampling(presence_penalty=-2.5), "presence_penalty must be between -2 and 2"),
        (wire.Sampling(frequency_penalty=float("nan")), "frequency_penalty must be between -2 and 2"),
        (wire.Sampling(repetition_penalty=11.0), "repetition_penalty must be between 0 and 10"),
        (wire.Sampling(logit_bias=((5, 1.0), (5, 2.0))), "must ascend"),
        (wire.Sampling(logit_bias=((5, 101.0),)), "between -100 and 100"),
        (wire.Sampling(logit_bias=tuple((i, 0.0) for i in range(301))), "at most 300 logit biases"),
    ],
)
def test_a_slot_refuses_sampling_out_of_range(sampling: wire.Sampling, message: str) -> None:
    with pytest.raises(wire.RequestInvalid, match=message):
        sampling.check()
