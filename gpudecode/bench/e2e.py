"""The real pipeline end to end: ``gpudecode decode`` of a corpus, one fresh process per device.

Each device's run is ``python -m gpudecode decode CONFIG -o runtime.device=DEV`` in a new process
(start-up real and measured), which writes its counts and :class:`gpudecode.job.RunTimings` to a
file (the hidden ``--timings`` option). From them and the parent's clock: utterances/s and RTFx
(audio seconds ÷ steady decode seconds, start-up excluded), time to first result (process start →
the first result written and flushed), total wall time, and the breakdown — start-up (imports,
sessions), reading, front end, encoder, search, writing (reading, the front end and writing as the
decoding loop waited for them: they may run in threads beside it), other (the rest: the run's tail, exit) —
plus GPU utilisation sampled with ``nvidia-smi`` on CUDA.

``repeat`` N decodes the corpus N times under distinct ids (``<id>-r1`` .. ``<id>-rN``): a Kaldi
script or an audio list is repeated line by line (nothing copied); other formats are written once
to a Kaldi archive whose script lists every utterance N times.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpudecode.bench.common import pyplot, save_figure, write_results

#: The breakdown's parts, in the order of the table and the figure.
PARTS = ("start-up", "reading", "front end", "encoder", "search", "writing", "other")
#: Seconds between two samples of GPU utilisation.
GPU_SAMPLE_MS = 100
#: Utterances of the untimed run before each measured one (``E2eOptions.warm_up``).
WARM_UP_UTTERANCES = 32
_TAIL = 2000  # characters of a failed run's stderr quoted in the error


class E2eError(RuntimeError):
    """A run of the bench failed (its command and the end of its error output are in the message)."""


@dataclasses.dataclass(frozen=True)
class E2eOptions:
    """What ``bench e2e`` runs: ``configs`` (YAML paths), each on every device of ``devices``
    (``cuda``, ``cpu``), on ``features`` (None: each config's own ``io.features``) repeated
    ``repeat`` times; ``overrides``: further ``-o KEY=VALUE`` of every run; ``results``: a folder
    that keeps each run's output (``<config stem>/<device>``; None: a temporary one); ``warm_up``:
    before each measured run, an untimed one of the corpus's first ``warm_up`` utterances (0: none),
    so that kernels compiled once per machine (CuPy's and NVRTC's disk caches) are not measured."""

    configs: tuple[str, ...]
    features: str | None = None
    repeat: int = 1
    devices: tuple[str, ...] = ("cpu",)
    overrides: tuple[str, ...] = ()
    results: str | None = None
    warm_up: int = WARM_UP_UTTERANCES

    def __post_init__(self):
        if not self.configs:
            raise ValueError("bench e2e: give at least one config")
        if self.repeat < 1:
            raise ValueError(f"bench e2e: repeat must be >= 1, got {self.repeat}")
        if self.warm_up < 0:
            raise ValueError(f"bench e2e: warm_up must be >= 0, got {self.warm_up}")
        bad = [d for d in self.devices if d not in ("cuda", "cpu")]
        if bad or not self.devices:
            raise ValueError(f"bench e2e: devices are cuda and/or cpu, got {','.join(self.devices) or 'none'}")


def default_devices() -> tuple[str, ...]:
    """``cuda, cpu`` where a GPU is usable, else ``cpu``."""
    from gpudecode.backend import gpu_available

    return ("cuda", "cpu") if gpu_available() else ("cpu",)


def repeated_corpus(path: str | Path, format: str, repeat: int, folder: Path,
                    limit: int | None = None) -> tuple[Path, str]:
    """(path, format) of the corpus at ``path`` (its first ``limit`` utterances, None: all)
    repeated ``repeat`` times under ids ``<id>-r<k>``, written into ``folder``; ``repeat`` 1 and
    no limit: the corpus itself."""
    from gpudecode import defaults
    from gpudecode.io.audio import read_audio_list
    from gpudecode.io.features import sorted_files
    from gpudecode.io.readers import detect_format, open_features

    path = Path(path).resolve()
    if format == "auto":
        format = detect_format(path)
    if repeat == 1 and limit is None:
        return path, format
    folder.mkdir(parents=True, exist_ok=True)
    if format == "audio":
        files = (read_audio_list(path) if path.is_file()
                 else {f.stem: f for f in sorted_files(path, defaults.AUDIO_EXTENSIONS)})
        entries = [(utt, str(Path(file).resolve())) for utt, file in files.items()][:limit]
        listed = folder / "audio.scp"
    else:
        if format == "kaldi-scp":
            script = path
        else:  # one copy, in a Kaldi archive
            import kaldiio

            script = folder / "corpus.scp"
            with open_features(path, format) as source, \
                    kaldiio.WriteHelper(f"ark,scp:{folder / 'corpus.ark'},{script}") as writer:
                for k, utterance in enumerate(source):
                    if limit is not None and k >= limit:
                        break
                    writer(utterance.id, utterance.features)
        entries = [tuple(line.split(maxsplit=1)) for line in script.read_text(encoding="utf-8").splitlines()
                   if line.strip()][:limit]
        listed, format = folder / "repeated.scp", "kaldi-scp"
    with open(listed, "w", encoding="utf-8") as out:
        for k in range(1, repeat + 1):
            out.writelines(f"{utt}-r{k} {where}\n" for utt, where in entries)
    return listed, format


class _GpuSampler:
    """GPU utilisation (%) of one device sampled by ``nvidia-smi`` while the context is open;
    :attr:`mean` None where ``nvidia-smi`` is missing or gave nothing."""

    def __init__(self, device_id: int):
        self.device_id, self.mean, self.samples, self._process = device_id, None, 0, None

    def __enter__(self):
        smi = shutil.which("nvidia-smi")
        if smi is not None:
            self._process = subprocess.Popen(
                [smi, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i", str(self.device_id),
                 "-lms", str(GPU_SAMPLE_MS)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc):
        if self._process is None:
            return
        self._process.terminate()
        out, _ = self._process.communicate()
        values = [float(v) for v in out.split() if v.replace(".", "", 1).isdigit()]
        if values:
            self.mean, self.samples = sum(values) / len(values), len(values)


def _command(config: str, device: str, features: Path, format: str, output: Path, timings: Path,
             overrides: tuple[str, ...]) -> list[str]:
    command = [sys.executable, "-m", "gpudecode", "decode", str(config), "--features", str(features),
               "--output", str(output), "--timings", str(timings), "-o", f"io.features.format={format}",
               "-o", "io.references=null", "-o", f"runtime.device={device}"]
    for override in overrides:
        command += ["-o", override]
    return command


def run_device(config: str, device: str, features: Path, format: str, output: Path, *,
               overrides: tuple[str, ...] = (), device_id: int = 0) -> dict:
    """One ``gpudecode decode`` of ``features`` on ``device`` in a new process (``output``: its
    results, which must not hold any); its row of the results."""
    timings_file = output.with_name(output.name + ".timings.json")
    command = _command(config, device, features, format, output, timings_file, overrides)
    with _GpuSampler(device_id) if device == "cuda" else _NoSampler() as sampler:
        spawned = time.time()
        done = subprocess.run(command, capture_output=True, text=True)
        ended = time.time()
    if done.returncode != 0:
        raise E2eError(f"bench e2e: {' '.join(command)} exited with {done.returncode}:\n{done.stderr[-_TAIL:]}")
    run = json.loads(timings_file.read_text(encoding="utf-8"))
    return _row(config, device, run, spawned, ended, sampler.mean, command, output)


class _NoSampler:
    mean = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _row(config: str, device: str, run: dict, spawned: float, ended: float, gpu_utilisation: float | None,
         command: list[str], output: Path) -> dict:
    """A device's figures from its run's counts and timings and the parent's clock."""
    t = run["timings"]
    total = ended - spawned
    startup = t["decoding_at"] - spawned
    steady = t["finished_at"] - t["decoding_at"]
    audio = run["frames"] * run["frame_shift_s"]
    # reading, the front end and writing may run in threads beside the decoding loop: the wall holds
    # only the loop's waits for them (the input wait shared between reading and the front end in
    # proportion to their work; their own seconds are in the run's timings)
    work_in = t["reading_s"] + t["front_end_s"]
    wait_in = t.get("input_wait_s", work_in)
    share = wait_in / work_in if work_in > 0 else 0.0
    parts = {"start-up": startup, "reading": t["reading_s"] * share, "front end": t["front_end_s"] * share,
             "encoder": t["encoder_s"], "search": t["search_s"], "writing": t.get("output_wait_s", t["writing_s"])}
    parts["other"] = total - sum(parts.values())
    first = None if t["first_result_at"] is None else t["first_result_at"] - spawned
    return {"config": str(config), "device": device, "utterances": run["decoded"], "audio_s": audio,
            "total_s": total, "startup_s": startup, "imports_s": t["started_at"] - spawned,
            "sessions_s": t["decoding_at"] - t["started_at"], "steady_s": steady,
            "first_result_s": first,
            "utterances_per_s": run["decoded"] / steady if steady > 0 else None,
            "utterances_per_s_total": run["decoded"] / total if total > 0 else None,
            "rtfx": audio / steady if steady > 0 else None,
            "breakdown_s": parts, "breakdown_share": {k: v / total for k, v in parts.items()},
            "gpu_utilisation_pct": gpu_utilisation, "processes": t.get("processes", 1),
            "command": " ".join(command), "output": str(output)}


def _config_features(config: str, overrides: tuple[str, ...]) -> tuple[str, str, int]:
    """(features path, format, device id) a config names (with ``overrides``)."""
    from gpudecode.config import load_config

    loaded = load_config(config, overrides)
    if loaded.io.features is None:
        raise E2eError(f"bench e2e: {config} names no io.features: pass --features")
    return str(loaded.io.features.path), loaded.io.features.format, loaded.runtime.device_id


def run_e2e_bench(options: E2eOptions, output_dir: str | None = "out/bench", name: str = "e2e") -> dict:
    """Runs every config of ``options`` on every device; writes ``<name>.json`` and ``<name>.png``
    into ``output_dir``; returns the results (``rows``: one per config and device; ``ratios``:
    GPU ÷ CPU throughput per config where both ran)."""
    rows, ratios = [], {}
    with tempfile.TemporaryDirectory(prefix="gpudecode-e2e-") as scratch:
        scratch = Path(scratch)
        results = Path(options.results).resolve() if options.results is not None else scratch / "results"
        corpora: dict[tuple[str, str], tuple[Path, str]] = {}
        warm_corpora: dict[tuple[str, str], tuple[Path, str]] = {}
        for config in options.configs:
            path, format, device_id = _config_features(config, options.overrides)
            if options.features is not None:
                path, format = options.features, "auto"
            key = (str(Path(path).resolve()), format)
            if key not in corpora:
                corpora[key] = repeated_corpus(path, format, options.repeat, scratch / f"corpus{len(corpora)}")
                if options.warm_up:
                    warm_corpora[key] = repeated_corpus(path, format, 1, scratch / f"warm{len(warm_corpora)}",
                                                        limit=options.warm_up)
            features, features_format = corpora[key]
            by_device = {}
            for device in options.devices:
                warm_up_s = None
                if options.warm_up:
                    warm = run_device(config, device, *warm_corpora[key], scratch / "warm-up" / Path(config).stem
                                      / device, overrides=options.overrides, device_id=device_id)
                    warm_up_s = warm["total_s"]
                output = results / Path(config).stem / device
                if output.exists():
                    shutil.rmtree(output)
                output.parent.mkdir(parents=True, exist_ok=True)
                by_device[device] = run_device(config, device, features, features_format, output,
                                               overrides=options.overrides, device_id=device_id)
                by_device[device]["warm_up_s"] = warm_up_s
                if options.results is None:
                    by_device[device]["output"] = None  # a temporary folder, gone
                rows.append(by_device[device])
            if "cuda" in by_device and "cpu" in by_device:
                gpu, cpu = by_device["cuda"], by_device["cpu"]
                ratios[str(config)] = {
                    "steady": gpu["utterances_per_s"] / cpu["utterances_per_s"],
                    "total": gpu["utterances_per_s_total"] / cpu["utterances_per_s_total"]}
    summary = {"bench": "e2e", "features": options.features, "repeat": options.repeat, "warm_up": options.warm_up,
               "devices": list(options.devices), "overrides": list(options.overrides),
               "python": sys.version.split()[0], "rows": rows, "ratios": ratios}
    return write_results(summary, output_dir, name, _plot)


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def format_table(results: dict) -> str:
    """The results as a markdown table, then GPU ÷ CPU throughput per config."""
    lines = ["| config | device | utterances | audio (s) | utt/s | RTFx | first result (s) | start-up (s) | "
             "total (s) | " + " / ".join(PARTS) + " (% of total) | GPU util. (%) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in results["rows"]:
        shares = " / ".join(f"{100 * r['breakdown_share'][p]:.0f}" for p in PARTS)
        device = r["device"] + (f" ×{r['processes']} processes" if r.get("processes", 1) > 1 else "")
        lines.append(f"| {Path(r['config']).name} | {device} | {r['utterances']} | {r['audio_s']:.0f} | "
                     f"{_fmt(r['utterances_per_s'], '.1f')} | {_fmt(r['rtfx'], ',.0f')} | "
                     f"{_fmt(r['first_result_s'], '.2f')} | {r['startup_s']:.2f} | {r['total_s']:.2f} | "
                     f"{shares} | {_fmt(r['gpu_utilisation_pct'], '.0f')} |")
    for config, ratio in results["ratios"].items():
        lines.append(f"\nGPU ÷ CPU throughput, {Path(config).name}: {ratio['steady']:.2f}× steady, "
                     f"{ratio['total']:.2f}× with start-up")
    return "\n".join(lines)


def _plot(results: dict, path: Path) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    rows = results["rows"]
    labels = [f"{Path(r['config']).stem} / {r['device']}" for r in rows]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.5 * len(rows)))
    left = [0.0] * len(rows)
    for part in PARTS:
        widths = [max(r["breakdown_s"][part], 0.0) for r in rows]
        ax.barh(labels, widths, left=left, label=part)
        left = [a + b for a, b in zip(left, widths)]
    for y, r in enumerate(rows):
        ax.text(left[y], y, f"  RTFx {_fmt(r['rtfx'], ',.0f')}", va="center", fontsize=8)
    ax.set_xlabel("seconds (wall, process start to exit)")
    ax.set_title(f"gpudecode decode end to end (corpus ×{results['repeat']})")
    ax.set_xlim(0, 1.15 * max(left))
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save_figure(plt, fig, path)
