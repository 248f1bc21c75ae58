"""Bad inputs found before decoding, each an ``Error:`` line or a warning naming the thing (issue
items 4, 6 and 8's small ones): a features folder holding several formats, references checked up
front, a recording shorter than one frame, the ``io.on_bad_input: skip`` hint, ``inspect`` of an
empty file, and the CUDA provider's missing libraries named with the command that installs them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from gpudecode.cli import main
from gpudecode.io.errors import ResultFileError
from gpudecode.io.wer import validate_references
from gpudecode.session.cuda_libs import (
    cuda_library_names,
    cuda_major,
    missing_libraries,
    preload_cuda_libraries,
    provider_failure,
)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "configs" / "random-aed.yaml"  # 16 mel bins at 8 kHz, features examples/features
FEATURES = ROOT / "examples" / "features"


def cli(*args, cwd=None):
    """The real command line in a subprocess: the warnings Python's logging prints reach stderr."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "gpudecode", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=env, timeout=120)


def write_wav(path: Path, num_samples: int, rate: int = 8000, seed: int = 0) -> Path:
    import soundfile

    noise = np.random.default_rng(seed).normal(0, 0.1, num_samples).astype(np.float32)
    soundfile.write(str(path), noise, rate)
    return path


# --- item 4: a folder of several formats ----------------------------------------------------------

def test_a_folder_holding_npy_and_wav_files_is_an_error_listing_both(tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    for file in FEATURES.glob("*.npy"):
        shutil.copy(file, folder)
    write_wav(folder / "speech.wav", 4000)
    write_wav(folder / "more.WAV", 4000)
    out = tmp_path / "out"
    result = cli("decode", EXAMPLE, "--features", folder, "--output", out)
    assert result.returncode == 1
    assert (f"Error: {folder}: folder holds several feature formats: 3 .npy file(s) (npy-dir), 2 .wav file(s) "
            "(audio); a run decodes one: move the others out, or set io.features.format (npy-dir or audio) to "
            "decode that one alone") in result.stderr
    assert not out.exists()  # nothing decoded, nothing written
    chosen = cli("decode", EXAMPLE, "--features", folder, "--output", out, "-o", "io.features.format=npy-dir")
    assert chosen.returncode == 0, chosen.stderr
    assert f"{folder}: format npy-dir decodes this folder's .npy files only; ignored: 2 .wav file(s)" in chosen.stderr
    assert sorted(line.split()[0] for line in (out / "text").read_text().splitlines()) == [
        "example-0", "example-1", "example-2"]


# --- item 6: references before decoding -----------------------------------------------------------

def test_duplicate_reference_ids_stop_the_run_before_decoding(tmp_path):
    refs = tmp_path / "refs"
    refs.write_text("example-0 a b\nexample-1 c\nexample-0 d\n")
    out = tmp_path / "out"
    result = cli("decode", EXAMPLE, "--output", out, "--references", refs)
    assert result.returncode == 1
    assert f"Error: {refs}: utterance 'example-0': line 3: duplicate id" in result.stderr
    assert not (out / "nbest.jsonl").exists() and not (out / "text").exists()


def test_non_utf8_references_stop_the_run_before_decoding(tmp_path):
    refs = tmp_path / "refs"
    refs.write_bytes("example-0 a b\nexample-1 caf\u00e9\n".encode("latin-1"))
    out = tmp_path / "out"
    result = cli("decode", EXAMPLE, "--output", out, "--references", refs)
    assert result.returncode == 1
    assert f"Error: {refs}: line 2: not UTF-8 text (byte 0xe9 at offset 27); save the file as UTF-8" in result.stderr
    assert not (out / "nbest.jsonl").exists()


def test_ids_missing_on_either_side_are_warned_before_decoding_and_counted_with_the_wer(tmp_path):
    refs = tmp_path / "refs"
    refs.write_text("example-0 a b\nexample-1 c\nghost-1 d e\n")
    out = tmp_path / "out"
    result = cli("decode", EXAMPLE, "--output", out, "--references", refs)
    assert result.returncode == 0, result.stderr
    warning = (f"references {refs}: 1 utterance(s) have no reference (left out of the WER): 'example-2'; "
               "1 reference(s) have no utterance to decode (counted as all deletions): 'ghost-1'")
    assert warning in result.stderr
    assert result.stderr.index(warning) < result.stderr.index("decoding")  # up front
    assert "hypotheses without reference   1 (left out of the WER)" in result.stdout
    assert "references without hypothesis  1 (counted as all deletions)" in result.stdout
    assert len((out / "text").read_text().splitlines()) == 3  # every utterance decoded all the same


def test_validate_references_counts_and_refuses():
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "refs"
        path.write_text("a x\nb y\nc z\n")
        check = validate_references(path, ["b", "c", "d", "e"])
        assert (check.num_references, check.without_reference, check.without_utterance) == (3, ("d", "e"), ("a",))
        assert validate_references(path, ["a", "b", "c"]).warning(path) is None
        path.write_text("a\nb\n")
        with pytest.raises(ResultFileError, match="the references hold no words"):
            validate_references(path, ["a"])
        path.write_text("")
        with pytest.raises(ResultFileError, match="no reference transcripts"):
            validate_references(path, ["a"])


# --- item 8: too short for one frame, the on_bad_input hint, inspect of an empty file --------------

def test_a_recording_shorter_than_one_frame_names_its_samples_and_the_frame_length(tmp_path):
    folder = tmp_path / "wavs"
    folder.mkdir()
    write_wav(folder / "tiny.wav", 80)
    write_wav(folder / "fine.wav", 4000)
    out = tmp_path / "out"
    result = cli("decode", EXAMPLE, "--features", folder, "--output", out)
    assert result.returncode == 1
    assert (f"Error: {folder / 'tiny.wav'}: utterance 'tiny': 80 samples: too short for one feature frame; one "
            "frame needs 200 samples (25 ms at 8000 Hz); to leave bad utterances out and go on, set "
            "io.on_bad_input: skip (-o io.on_bad_input=skip)") in result.stderr
    assert "zero frames" not in result.stderr
    skipped = cli("decode", EXAMPLE, "--features", folder, "--output", out, "-o", "io.on_bad_input=skip")
    assert skipped.returncode == 0, skipped.stderr
    assert "skipped (bad input)     1" in skipped.stdout
    assert [line.split()[0] for line in (out / "text").read_text().splitlines()] == ["fine"]


def test_the_stopping_error_of_bad_features_names_on_bad_input_skip(tmp_path):
    folder = tmp_path / "feats"
    shutil.copytree(FEATURES, folder)
    bad = np.load(folder / "example-1.npy")
    bad[3, 2] = np.nan
    np.save(folder / "example-1.npy", bad)
    result = CliRunner().invoke(main, ["decode", str(EXAMPLE), "--features", str(folder), "--output",
                                       str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "utterance 'example-1': NaN in frame 3" in result.output
    assert "set io.on_bad_input: skip (-o io.on_bad_input=skip)" in result.output


def test_inspect_of_an_empty_file_is_an_error(tmp_path):
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    result = CliRunner().invoke(main, ["inspect", str(empty)])
    assert result.exit_code == 1
    assert f"Error: {empty}: empty file (0 bytes), not an ONNX model" in result.output


# --- the CUDA provider's libraries -----------------------------------------------------------------

def _fake_ort(name: str, version: str = "1.26.0", preload=None) -> types.ModuleType:
    ort = types.ModuleType(name)  # not importable: its build info says nothing, so CUDA 12 names
    ort.__version__ = version
    if preload is not None:
        ort.preload_dlls = preload
    return ort


def test_the_cuda_provider_failure_names_the_missing_libraries_and_the_install_command():
    hidden = {"libcublasLt.so.12", "libcudnn.so.9"}
    loaded = []

    def load(name):  # the dynamic loader, with two libraries hidden
        if name in hidden:
            raise OSError(f"{name}: cannot open shared object file: No such file or directory")
        loaded.append(name)

    message = provider_failure(_fake_ort("fake_ort_a"), "decoder.onnx", ["CPUExecutionProvider"], load=load)
    assert message.startswith("decoder.onnx: CUDA was requested but ONNX Runtime runs the model on "
                              "['CPUExecutionProvider']: the CUDA execution provider did not load")
    assert ("missing libraries: libcublasLt.so.12: cannot open shared object file: No such file or directory; "
            "libcudnn.so.9: cannot open shared object file: No such file or directory") in message
    assert 'pip install "onnxruntime-gpu[cuda,cudnn]==1.26.0" (or reinstall the toolkit with its "cuda12" extra)' \
        in message
    assert "libcudart.so.12" in loaded and "libcudart.so.12" not in message
    everything = provider_failure(_fake_ort("fake_ort_b"), "m.onnx", [], load=lambda name: None)
    assert "missing libraries" not in everything and "the provider itself failed" in everything
    assert cuda_library_names("13") == ("libcudart.so.13", "libcublasLt.so.13", "libcublas.so.13",
                                        "libcurand.so.10", "libcufft.so.12", "libcudnn.so.9")


def test_preload_dlls_runs_once_and_its_report_is_kept():
    calls = []

    def preload():
        calls.append(1)
        print("Failed to load libcudnn.so.9: cannot open shared object file")

    ort = _fake_ort("fake_ort_c", preload=preload)
    assert preload_cuda_libraries(ort) == "Failed to load libcudnn.so.9: cannot open shared object file"
    assert preload_cuda_libraries(ort) == "Failed to load libcudnn.so.9: cannot open shared object file"
    assert calls == [1]
    assert preload_cuda_libraries(_fake_ort("fake_ort_d")) == ""  # an ONNX Runtime before 1.21
    message = provider_failure(ort, "m.onnx", ["CPUExecutionProvider"], load=lambda name: None,
                               preload_report=preload_cuda_libraries(ort))
    assert "onnxruntime.preload_dlls() reported: Failed to load libcudnn.so.9" in message


def test_the_cuda_extras_bring_nvidia_s_library_wheels():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, cupy in (("cuda12", "cupy-cuda12x[ctk]"), ("cuda13", "cupy-cuda13x[ctk]")):
        assert any(r.startswith("onnxruntime-gpu[cuda,cudnn]>=") for r in extras[extra]), extras[extra]
        assert any(r.startswith(cupy) for r in extras[extra]), extras[extra]


@pytest.mark.gpu
def test_the_cuda_provider_loads_after_preload_dlls():
    """On a GPU machine: ``preload_dlls()`` runs before the first CUDA session, the session runs on
    the CUDA provider, and no CUDA or cuDNN library the provider needs is missing."""
    import onnxruntime

    from gpudecode.session import OnnxSession, SessionOptions

    assert hasattr(onnxruntime, "preload_dlls"), onnxruntime.__version__
    session = OnnxSession(ROOT / "examples" / "models" / "encoder.onnx", SessionOptions(device="cuda"))
    assert session.session.get_providers()[0] == "CUDAExecutionProvider"
    assert missing_libraries(cuda_library_names(cuda_major(onnxruntime))) == []


@pytest.mark.gpu
def test_the_cuda_provider_loads_through_preload_dlls_from_nvidia_s_wheels():
    """On a GPU machine with the cuda12/cuda13 extra (NVIDIA's wheels installed beside onnxruntime):
    the CUDA and cuDNN libraries in the process are those of the wheels."""
    import onnxruntime

    # preload_dlls() looks for NVIDIA's wheels in onnxruntime's own site-packages folder
    if not (Path(onnxruntime.__file__).parent.parent / "nvidia" / "cudnn").is_dir():
        pytest.skip("NVIDIA's cuDNN wheel is not installed beside onnxruntime here (the cuda12 / cuda13 extra "
                    "brings it)")
    test_the_cuda_provider_loads_after_preload_dlls()
    maps = Path("/proc/self/maps").read_text()
    for name in ("libcudnn.so.9", "libcublasLt.so."):
        paths = {line.split()[-1] for line in maps.splitlines() if name in line}
        assert paths and all("site-packages/nvidia" in p for p in paths), paths
