"""Results handed to the writer a batch at a time: ``WriterThread``'s depth counts results, a
write that fails stops the writing at once, ``write_many`` on a full disk counts none of its batch
done and resume finishes the files; the decoding loop (``run._decode_all``) hands over a batch's
results together (the run's first written alone) and, on an error in the middle of a batch, writes
what the batch decoded before it."""

import contextlib
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

import gpudecode.run as run
from gpudecode.io import ResultWriter, UtteranceResult, read_done_ids
from gpudecode.io.writer_thread import WriterThread
from gpudecode.job import RunSummary, RunTimings
from tests.test_cli_errors import faulty_disk
from tests.test_writers_fast import SHIFT, _hyp, _reference, _vocab

NUM_UTTS = 12


def _started(call) -> threading.Thread:
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread


def test_the_depth_counts_results_and_a_larger_item_goes_alone():
    release, written = threading.Event(), []

    def write(item):
        release.wait()
        written.append(item)

    with WriterThread(write, 4) as writer:
        writer.put("a", 2)  # taken by the thread at once, which waits in write
        time.sleep(0.05)
        writer.put("b", 3)
        writer.put("c", 1)  # 4 results queued: full
        waiting = _started(lambda: writer.put("d", 1))
        waiting.join(0.2)
        assert waiting.is_alive()
        release.set()
        waiting.join(1.0)
        assert not waiting.is_alive()
        writer.put("e", 9)  # larger than the depth: queued once nothing else is
    assert written == ["a", "b", "c", "d", "e"]


def test_a_failed_write_is_raised_by_a_put_that_waits_and_nothing_after_it_is_written():
    release, written, full = threading.Event(), [], OSError(28, "No space left on device")

    def write(item):
        release.wait()
        if item == "b":
            raise full
        written.append(item)

    writer = WriterThread(write, 2)
    writer.put("a", 2)
    time.sleep(0.05)
    writer.put("b", 2)
    raised = []

    def put():
        try:
            writer.put("c", 2)
        except OSError as error:
            raised.append(error)

    waiting = _started(put)
    release.set()
    waiting.join(1.0)
    assert raised == [full] and raised[0] is full
    writer.close()  # does not raise it again
    assert written == ["a"]


@pytest.mark.parametrize("full_in", ["hyp.ctm", "nbest.jsonl"])
def test_write_many_on_a_full_disk_counts_none_done_and_resume_finishes(tmp_path, monkeypatch, full_in):
    results = [UtteranceResult(id=f"u{i}", nbest=[_hyp([4, 5, 6], frames=[0, 2, 3])]) for i in range(4)]
    chunk, expected = results[1:], _reference(results, _vocab(), "none")
    first = _reference(results[:1], _vocab(), "none")
    room = sum(map(len, first.values())) + 7  # u0, then 7 bytes of the chunk's CTM lines
    if full_in == "nbest.jsonl":  # u0, the chunk's CTM and text lines, its first JSON line, 7 bytes
        room = (sum(map(len, expected.values())) - len(expected["nbest.jsonl"])
                + 2 * len(first["nbest.jsonl"]) + 7)
    out = tmp_path / "out"
    faulty_disk(monkeypatch, out, full_after_bytes=room)
    writer = ResultWriter(out, _vocab(), formats=("ctm", "text", "jsonl"), frame_shift_s=SHIFT)
    monkeypatch.undo()
    writer.write(results[0])
    with pytest.raises(OSError) as raised:
        writer.write_many(chunk)
    with contextlib.suppress(OSError):  # the rest of the chunk, still buffered
        writer.close()
    assert str(raised.value.filename) == str(out / full_in)
    assert (writer.num_written, writer.done_ids) == (1, {"u0"})
    done = read_done_ids(out)
    assert done == ({"u0"} if full_in == "hyp.ctm" else {"u0", "u1"})  # u1's lines all made it
    with ResultWriter(out, _vocab(), formats=("ctm", "text", "jsonl"), frame_shift_s=SHIFT,
                      resume=True) as writer:
        assert writer.done_ids == done
        writer.write_many([r for r in results if r.id not in done])
    assert {name: (out / name).read_bytes() for name in expected} == expected


class Boom(Exception):
    """An error in the middle of a batch."""


class StandInDecoder:
    """One hypothesis per utterance; ``out_of_memory`` ids: out of GPU memory when decoded
    together (the batch is then decoded in halves); ``failing``: an id whose decoding raises Boom."""

    def __init__(self, out_of_memory=(), failing=None):
        self.out_of_memory, self.failing = set(out_of_memory), failing

    def decode_batch(self, ids, features, **padding):
        if len(ids) > 1 and self.out_of_memory & set(ids):
            raise MemoryError("out of memory")
        if self.failing in ids:
            raise Boom
        return [[_hyp([4 + n % 3, 5], frames=[n, n + 1])] for n in range(len(ids))]


class Batches:
    """``NUM_UTTS`` utterances of 10 + i frames, two a batch."""

    utterances = [SimpleNamespace(id=f"u{i}", features=np.zeros((10 + i, 2)), prompt=None,
                                  num_frames=10 + i) for i in range(NUM_UTTS)]

    def batches(self, sizing, exclude):
        return (self.utterances[i:i + 2] for i in range(0, NUM_UTTS, 2))


class Counting(ResultWriter):
    """Notes how many results each ``write_many`` is given."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def write_many(self, results):
        results = list(results)
        self.calls.append(len(results))
        super().write_many(results)


def _decode_all(tmp_path, decoder, queue):
    """``run._decode_all`` over ``Batches`` into a ``Counting`` writer: the writer and the summary."""
    config = SimpleNamespace(batch_sizing=None, io=SimpleNamespace(on_bad_input="stop"),
                             runtime=SimpleNamespace(prefetch_batches=2, writer_queue=queue))
    summary = RunSummary(frame_shift_s=0.01, timings=RunTimings(decoding_at=time.time()))
    with Counting(tmp_path / "out", _vocab(), formats=("ctm", "text", "jsonl"), frame_shift_s=SHIFT) as writer:
        try:
            run._decode_all(decoder, Batches(), writer, config, summary, exclude=set(), progress=None,
                            total=NUM_UTTS, start=time.perf_counter())
        finally:
            summary.timings.finished_at = time.time()
    return writer, summary


@pytest.mark.parametrize("queue", [0, 256])
def test_each_batch_is_written_together_after_the_runs_first_result_alone(tmp_path, queue):
    writer, summary = _decode_all(tmp_path, StandInDecoder(), queue)
    assert writer.calls == [1, 1] + [2] * (NUM_UTTS // 2 - 1)  # the first result's time is measured
    assert summary.decoded == NUM_UTTS and summary.frames == sum(u.num_frames for u in Batches.utterances)
    timings = summary.timings
    assert timings.decoding_at <= timings.first_result_at <= timings.finished_at
    assert read_done_ids(tmp_path / "out") == {u.id for u in Batches.utterances}


@pytest.mark.parametrize("queue", [0, 256])
def test_an_error_in_the_middle_of_a_batch_writes_what_it_decoded_before(tmp_path, queue):
    decoder = StandInDecoder(out_of_memory={"u4"}, failing="u5")  # u4 decoded alone, then u5 fails
    with pytest.raises(Boom):
        _decode_all(tmp_path, decoder, queue)
    assert read_done_ids(tmp_path / "out") == {"u0", "u1", "u2", "u3", "u4"}
    assert len((tmp_path / "out" / "text").read_text().splitlines()) == 5
