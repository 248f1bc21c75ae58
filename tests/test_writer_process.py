"""``ChildResultWriter`` (``runtime.writer_process``): the same files byte for byte as the in-process
``ResultWriter``, the same counts, the child's errors raised in the parent (a result that cannot be
formatted, a full disk, a failed open), whole lines only when the parent goes away, SIGINT ignored,
a crashed child reported."""

import errno
import math
import os
import pickle
import signal
import threading

import pytest

from gpudecode.config import load_config
from gpudecode.hypothesis import Hypothesis
from gpudecode.io.vocabulary import Vocabulary
from gpudecode.io.writer_process import ChildResultWriter, WriterProcessError, child_environment, serve
from gpudecode.io.writers import ResultWriter, UtteranceResult, read_done_ids
from tests.test_cli_errors import faults
from tests.test_overlap import EXAMPLE

VOCAB = Vocabulary(["<blank>", "a", "b", "c", "</s>"], blank="<blank>", sentence_end="</s>")
FILES = ("text", "nbest.jsonl", "hyp.ctm")


def results(count: int, start: int = 0) -> list[UtteranceResult]:
    """``count`` utterances of up to three hypotheses: frames, two scorers, a NaN, a truncated one,
    every fifth with an empty n-best list."""
    made = []
    for u in range(start, start + count):
        nbest = [] if u % 5 == 4 else [
            Hypothesis(labels=[1 + (u + k) % 3, 1 + k % 3], score=-0.5 * k - u / 7,
                       scores={"ctc": -0.25 * k, "lm": math.nan if (u, k) == (2, 1) else -1.0 / (k + 1)},
                       length=2, frames=[k, k + 3], truncated=(u + k) % 4 == 3)
            for k in range(1 + u % 3)]
        made.append(UtteranceResult(id=f"utt{u:03d}", nbest=nbest))
    return made


def writer_kwargs(resume: bool = False) -> dict:
    return {"formats": ("text", "jsonl", "ctm"), "frame_shift_s": 0.04, "resume": resume}


def files(folder) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in FILES}


def test_the_files_are_byte_equal_to_the_in_process_writers(tmp_path):
    batches = [results(1), results(20, 1), results(3, 21)]
    with ResultWriter(tmp_path / "here", VOCAB, **writer_kwargs()) as here, \
            ChildResultWriter(tmp_path / "child", VOCAB, **writer_kwargs()) as child:
        for batch in batches:
            here.write_many(batch)
            child.write_many(batch)  # 20 results: three messages, pipelined
            assert (child.num_written, child.done_ids) == (here.num_written, here.done_ids)
    assert child.num_written == 24
    assert files(tmp_path / "child") == files(tmp_path / "here")
    assert b"NaN" not in (tmp_path / "child" / "nbest.jsonl").read_bytes()  # null, as in-process


def test_resume_cuts_back_a_torn_line_as_the_in_process_writer_does(tmp_path):
    for name in ("here", "child"):
        with ResultWriter(tmp_path / name, VOCAB, **writer_kwargs()) as writer:
            writer.write_many(results(6))
        with open(tmp_path / name / "nbest.jsonl", "a") as torn:
            torn.write('{"id": "utt006", "te')
    with ResultWriter(tmp_path / "here", VOCAB, **writer_kwargs(resume=True)) as here:
        here.write_many(results(3, 6))
    with ChildResultWriter(tmp_path / "child", VOCAB, **writer_kwargs(resume=True)) as child:
        child.write_many(results(3, 6))
    assert files(tmp_path / "child") == files(tmp_path / "here")
    assert read_done_ids(tmp_path / "child") == {f"utt{u:03d}" for u in range(9)}


def test_a_result_that_cannot_be_formatted_raises_the_childs_error_after_those_before_it(tmp_path):
    bad = results(12)
    bad[9] = UtteranceResult(id="utt009", nbest=[Hypothesis(labels=[99], score=0.0, length=1, frames=[0])])
    raised = {}
    for name, writer_type in (("here", ResultWriter), ("child", ChildResultWriter)):
        writer = writer_type(tmp_path / name, VOCAB, **writer_kwargs())
        with pytest.raises(Exception) as info:
            writer.write_many(bad)
        raised[name] = (type(info.value), str(info.value), writer.num_written)
        if name == "child":
            with pytest.raises(type(info.value)):  # nothing more is written after a failure
                writer.write_many(results(1, 20))
        writer.close()
    assert raised["child"] == raised["here"] and raised["here"][2] == 9  # those before the bad one
    assert files(tmp_path / "child") == files(tmp_path / "here")


def test_a_full_disk_in_the_child_is_an_oserror_with_its_errno_and_file(tmp_path, monkeypatch):
    """``serve`` (the child's loop) in this process, behind pipes, with ``open`` as a disk that is
    full after 300 bytes: the error comes back through the pipe as it was raised."""
    requests_r, requests_w = os.pipe()
    answers_r, answers_w = os.pipe()
    monkeypatch.setattr("builtins.open", faults().make_open(open, tmp_path, full_after_bytes=300))
    child = threading.Thread(target=serve, args=(os.fdopen(requests_r, "rb"), os.fdopen(answers_w, "wb")))
    child.start()
    requests, answers = os.fdopen(requests_w, "wb"), os.fdopen(answers_r, "rb")

    def ask(message):
        pickle.dump(message, requests)
        requests.flush()
        return pickle.load(answers)

    out = tmp_path / "out"
    assert ask(("open", {"output_folder": str(out), "vocabulary": VOCAB, **writer_kwargs()})) == ("opened",)
    answer = ask(("write", results(40)))
    assert answer[0] == "failed" and answer[1] == 0
    error = answer[2]
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC
    assert os.fspath(error.filename) == str(out / "hyp.ctm")  # the first file written
    assert ask(("write", results(1, 40)))[:2] == ("failed", 0)
    assert ask(("close",))[0] in ("closed", "failed")
    child.join(10)
    assert not child.is_alive()
    requests.close()
    answers.close()


def test_a_failed_open_raises_at_the_first_write_and_not_again_at_close(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    with pytest.raises(OSError) as here:
        ResultWriter(blocked, VOCAB, **writer_kwargs())
    writer = ChildResultWriter(blocked, VOCAB, **writer_kwargs())
    with pytest.raises(OSError) as child:
        writer.write_many(results(2))
    assert (type(child.value), child.value.errno, child.value.filename) == (
        type(here.value), here.value.errno, here.value.filename)
    writer.close()
    assert writer._child.returncode == 0


def test_a_parent_that_goes_away_mid_message_leaves_whole_lines(tmp_path):
    writer = ChildResultWriter(tmp_path / "out", VOCAB, **writer_kwargs())
    writer.write_many(results(4))
    message = pickle.dumps(("write", results(4, 4)))
    writer._child.stdin.write(message[:len(message) // 2])  # the parent dies mid-message
    writer._child.stdin.close()
    assert writer._child.wait(10) == 0
    assert read_done_ids(tmp_path / "out") == {f"utt{u:03d}" for u in range(4)}
    for name in FILES:
        text = (tmp_path / "out" / name).read_text()
        assert text.endswith("\n") and "utt004" not in text


def test_the_child_ignores_sigint_and_a_killed_child_is_reported(tmp_path):
    writer = ChildResultWriter(tmp_path / "out", VOCAB, **writer_kwargs())
    writer.write_many(results(2))  # (the child is running its loop: SIGINT is ignored by now)
    os.kill(writer._child.pid, signal.SIGINT)
    writer.write_many(results(2, 2))
    assert writer.num_written == 4
    writer._child.kill()
    writer._child.wait()
    with pytest.raises(WriterProcessError, match="--resume"):
        writer.write_many(results(1, 4))
    writer.close()
    assert read_done_ids(tmp_path / "out") == {f"utt{u:03d}" for u in range(4)}


@pytest.mark.parametrize("device, setting, expected", [
    ("cpu", "auto", False), ("cuda", "auto", True), ("cpu", "true", True), ("cuda", "false", False)])
def test_writer_process_auto_is_on_for_cuda(device, setting, expected):
    config = load_config(EXAMPLE, [f"runtime.device={device}", f"runtime.writer_process={setting}"])
    assert config.runtime.writes_in_child is expected


def test_a_call_interrupted_before_its_answers_is_counted_by_the_next_call_or_close(tmp_path):
    """Ctrl-C between sending a call's messages and reading their answers (a writer run in the
    decoding loop): the next call, or ``close``, reads them first, so the counts stay right."""
    writer = ChildResultWriter(tmp_path / "out", VOCAB, **writer_kwargs())
    writer.write_many(results(3))
    for chunk in (results(8, 3), results(2, 11)):  # what write_many sends, its answers left unread
        writer._send(("write", chunk))
        writer._unanswered.append(chunk)
    writer.write_many(results(1, 13))
    assert writer.num_written == 14 and writer.done_ids == {f"utt{u:03d}" for u in range(14)}
    writer._send(("write", results(2, 14)))
    writer._unanswered.append(results(2, 14))
    writer.close()
    assert writer.num_written == 16
    assert read_done_ids(tmp_path / "out") == {f"utt{u:03d}" for u in range(16)}


def test_the_child_imports_this_gpudecode_from_any_working_directory(tmp_path, monkeypatch):
    import gpudecode

    monkeypatch.chdir(tmp_path)  # (no gpudecode here or on the inherited path by this alone)
    writer = ChildResultWriter(tmp_path / "out", VOCAB, **writer_kwargs())
    writer.write_many(results(2))
    writer.close()
    assert writer.num_written == 2
    first = child_environment()["PYTHONPATH"].split(os.pathsep)[0]
    assert os.path.samefile(first, os.path.dirname(os.path.dirname(gpudecode.__file__)))
