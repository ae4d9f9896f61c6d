"""The Python view of the slot ABI must match the C header as an independent compiler sees it."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from edgepath.native import abi

NATIVE = Path(abi.__file__).resolve().parent
LOAD = abi.struct_dtype("ep_load")
STRUCTS = {
    "ep_pool_header": abi.POOL_HEADER,
    "ep_load": LOAD,
    "ep_request_header": abi.REQUEST_HEADER,
    "ep_result_header": abi.RESULT_HEADER,
}
CONSTANTS = [
    "EP_POOL_MAGIC",
    "EP_ABI_VERSION",
    "EP_FREE",
    "EP_CLAIMED",
    "EP_READY",
    "EP_RUNNING",
    "EP_DONE",
    "EP_DOORBELL_VALID",
    "EP_SLOT_MAX",
    "EP_CLAIMANT_MAX",
    "EP_STATUS_NO_SLOT",
    "EP_PREFIX_BLOCK",
    "EP_PREFIX_SEED",
    "EP_PREFIX_MUL",
    "EP_PREFIX_ENTRIES_MAX",
    "EP_LOAD_PROMPTS",
]


def _gcc_layout(tmp_path: Path) -> dict[str, int]:
    """Compile a C program against the header that prints sizeof/offsetof of every field."""
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "edgepath_slot.h"', "int main(void) {"]
    for struct, dtype in STRUCTS.items():
        lines.append(f'printf("{struct} %zu\\n", sizeof(struct {struct}));')
        for name in dtype.names:
            lines.append(f'printf("{struct}.{name} %zu\\n", offsetof(struct {struct}, {name}));')
    for const in CONSTANTS:
        lines.append(f'printf("{const} %llu\\n", (unsigned long long)({const}));')
    lines.append("return 0; }")
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "layout"
    subprocess.run(["gcc", "-std=c11", "-I", str(NATIVE), str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is needed to compile the layout probe")
def test_dtypes_match_an_independent_compile_of_the_header(tmp_path: Path) -> None:
    c = _gcc_layout(tmp_path)
    for struct, dtype in STRUCTS.items():
        assert dtype.itemsize == c[struct], struct
        for name in dtype.names:
            assert dtype.fields[name][1] == c[f"{struct}.{name}"], f"{struct}.{name}"
    for const in CONSTANTS:
        assert getattr(abi.lib, const) == c[const], const


def test_fixed_parts_are_whole_cache_lines() -> None:
    assert abi.REQUEST_HEADER.itemsize % 64 == 0
    assert abi.RESULT_HEADER.itemsize % 64 == 0
    assert abi.POOL_HEADER.itemsize % 64 == 0
    assert LOAD.itemsize % 64 == 0


def test_magic_spells_edgepool() -> None:
    assert np.uint64(abi.MAGIC).tobytes() == b"EDGEPOOL"


def test_token_fields_are_typed_as_the_header_declares() -> None:
    assert abi.REQUEST_HEADER.fields["token_count"][0] == np.dtype(np.uint32)
    assert abi.RESULT_HEADER.fields["status"][0] == np.dtype(np.int32)
    assert LOAD.fields["begin"][0] == LOAD.fields["end"][0] == LOAD.fields["longest"][0] == np.dtype(np.uint64)
    assert LOAD.fields["prompt_ms"][0] == np.dtype(np.float32)
    assert LOAD.fields["prompts"][0] == np.dtype((np.uint32, 2 * abi.lib.EP_LOAD_PROMPTS))
    assert abi.POOL_HEADER.fields["prefix_entries"][0] == np.dtype(np.uint64)
    assert abi.REQUEST_HEADER.fields["temperature"][0] == np.dtype(np.float32)


def test_the_load_region_lies_between_the_heartbeat_and_the_state_words() -> None:
    """Read in the same READ as the heartbeat and state words: right after the header, whole cache lines, its
    sequence lock's end word first and begin word last."""
    heartbeat = abi.field_offset(abi.POOL_HEADER, "heartbeat")
    layout = abi.ffi.new("struct ep_pool_header *")
    assert abi.lib.ep_pool_layout(4, 16, 16, layout) == abi.lib.EP_OK
    assert heartbeat < layout.load_offset == abi.POOL_HEADER.itemsize
    assert layout.load_offset + LOAD.itemsize == layout.states_offset and layout.load_offset % 64 == 0
    assert abi.field_offset(LOAD, "end") == 0 and abi.field_offset(LOAD, "begin") == LOAD.itemsize - 8


def test_a_published_load_region_is_whole_and_its_version_moves() -> None:
    region = np.zeros(1, dtype=LOAD)
    fields = np.zeros(1, dtype=LOAD)
    fields["prompt_ms"], fields["decoding"], fields["prompts"][0][:2] = 1.5, 3, (7, 9)
    ptr = abi.ffi.cast("struct ep_load *", abi.ffi.from_buffer(region))
    versions = []
    for _ in range(2):
        before = time.monotonic_ns()
        abi.lib.ep_load_publish(ptr, abi.ffi.cast("struct ep_load *", abi.ffi.from_buffer(fields)))
        version = int(region["end"][0])
        assert int(region["begin"][0]) == version and abi.lib.ep_load_whole(ptr)
        assert before <= version <= time.monotonic_ns()  # the server's CLOCK_MONOTONIC when it published (ABI 11)
        assert region["prompt_ms"][0] == np.float32(1.5) and region["decoding"][0] == 3
        assert list(region["prompts"][0][:2]) == [7, 9]
        versions.append(version)
    assert versions[1] > versions[0]
    region["begin"] = versions[1] + 1  # a writer that has begun the next version
    assert not abi.lib.ep_load_whole(ptr)
    region["end"] = region["begin"] = 2**63  # a version ahead of the clock (a restarted machine): the next still moves
    abi.lib.ep_load_publish(ptr, abi.ffi.cast("struct ep_load *", abi.ffi.from_buffer(fields)))
    assert int(region["end"][0]) == int(region["begin"][0]) == 2**63 + 1


def test_the_heartbeat_is_the_servers_clock_and_always_moves() -> None:
    """ABI 11: each advance stores the server's CLOCK_MONOTONIC in ns, at least one more than the word held."""
    word = np.zeros(1, dtype=np.uint64)
    ptr = abi.ffi.cast("uint64_t *", abi.ffi.from_buffer(word))
    before = time.monotonic_ns()
    abi.lib.ep_heartbeat_tick(ptr)
    first = int(word[0])
    assert before <= first <= time.monotonic_ns()
    abi.lib.ep_heartbeat_tick(ptr)
    assert int(word[0]) > first
    word[0] = 2**63
    abi.lib.ep_heartbeat_tick(ptr)
    assert int(word[0]) == 2**63 + 1


def test_the_heartbeat_sits_in_the_pool_headers_last_cache_line_before_the_load_region() -> None:
    """One READ of [heartbeat .. state[n-1]] gives an agent the heartbeat, the load region and the state words:
    the word is an aligned u64 in the header's last cache line, which ends where the load region begins."""
    offset = abi.field_offset(abi.POOL_HEADER, "heartbeat")
    assert abi.POOL_HEADER.fields["heartbeat"][0] == np.dtype(np.uint64)
    assert offset % 8 == 0
    layout = abi.ffi.new("struct ep_pool_header *")
    assert abi.lib.ep_pool_layout(4, 16, 16, layout) == abi.lib.EP_OK
    assert layout.load_offset - 64 <= offset < layout.load_offset
