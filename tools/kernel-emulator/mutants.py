"""Mutation check of run.sh: each mutant is a copy of REPO with one deliberate kernel/driver bug;
run.sh must FAIL on every one. Usage: python mutants.py REPO [NAME ...]"""
import shutil, subprocess, sys, time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MUTANTS = {  # name: (file, old, new) -- old must occur exactly once
    "tie-check-index": ("kernels/ctc_frame.cu", "s_top_x[num_top - 2]", "s_top_x[num_top - 3]"),
    "tie-check-index-old": ("kernels/ctc_frame.cu", "top[num_top - 2]", "top[num_top - 3]"),
    "no-tie-fallback": ("kernels/ctc_frame.cu", "tie = at_end == after && at_end > neg_inf();", "tie = false;"),
    "rank-off-by-one": ("kernels/block_top_beam.cuh", "rank += warp_lists[f] > key", "rank += warp_lists[f] >= key"),
    "rank-old-winner": ("kernels/block_top_beam.cuh", "if (mine == winner && mine != 0ull)", "if (mine == winner && round > 0)"),
    "missing-barrier-top-beam": ("kernels/block_top_beam.cuh", "        if (lane == 0) warp_lists[warp * beam + round] = winner;\n    }\n    __syncthreads();",
                                 "        if (lane == 0) warp_lists[warp * beam + round] = winner;\n    }\n"),
    "missing-barrier-recombination": ("kernels/ctc_frame.cu", "            s_tie[j] = tie;\n        }\n        __syncthreads();",
                                      "            s_tie[j] = tie;\n        }\n"),
    "tie-break-reversed": ("kernels/packed_key.cuh", "| (unsigned long long)(~column);", "| (unsigned long long)(column);"),
    "skip-frame-values": ("kernels/ctc_frame.cu", "s_top_x[k_own] = frame.keep ? top_values[at] : neg_inf();",
                          "s_top_x[k_own] = top_values[at];"),
    "top-labels-no-row-guard": ("kernels/ctc_frame.cu", "if (row >= num_rows) return;  // the whole warp", ""),
    "trace-reverse-short": ("kernels/emission_tree.cu", "i < j; ++i, --j", "i < j - 1; ++i, --j"),
    "trace-groups-chunk-edge": ("kernels/emission_tree.cu", "while (current >= base) {", "while (current > base) {"),
    "trace-groups-swap-short": ("kernels/emission_tree.cu", "if (i < length / 2) {", "if (i < (length - 1) / 2) {"),
    "trace-groups-no-barrier": ("kernels/emission_tree.cu", "        lengths[first_row + t] = s_length[t];\n    }\n    __syncthreads();",
                                "        lengths[first_row + t] = s_length[t];\n    }\n"),
    "trace-groups-frame-step": ("kernels/emission_tree.cu", "frame_row[depth] = s_frame[i / group_size];", "frame_row[depth] = s_frame[i % group_size];"),
    "warp-rounds-short": ("kernels/block_top_beam.cuh", "round < beam; ++round) {  // this warp's best", "round < beam - 1; ++round) {  // this warp's best"),
    "rank-skips-last-listed": ("kernels/block_top_beam.cuh", "f < listed; ++f", "f < listed - 1; ++f"),
    "threshold-halved": ("kernels/block_top_beam.cuh", "floor_key = best - threshold;", "floor_key = best - 0.5f * threshold;"),
    "no-recombination-kill": ("kernels/ctc_frame.cu", "if (s_kill_lane[j] == i && s_kill_label[j] == v) return true;", "if (false) return true;"),
    "no-retime": ("kernels/ctc_frame.cu", "s_retime[j] = matched && merged >", "s_retime[j] = false && merged >"),
    "collision-check-off": ("kernels/search_math.cuh", "pending = node_label[a] == node_label[b];", "pending = true;"),
    "top-labels-keep-blank": ("kernels/ctc_frame.cu", "value >= tau && v < vocab_size && v != blank;", "value >= tau && v < vocab_size;"),
    "top-labels-fallback-keep-blank": ("kernels/ctc_frame.cu", "if (v < vocab_size && v != blank) keep_best(", "if (v < vocab_size) keep_best("),
    "top-labels-lane-best-keeps-blank": ("kernels/ctc_frame.cu", "v < vocab_size && v != blank ? fmaxf(value, neg_inf())", "v < vocab_size ? fmaxf(value, neg_inf())"),
    "top-labels-tau-one-too-high": ("kernels/ctc_frame.cu", "if (count[r] >= P) tau", "if (count[r] >= P - 1) tau"),
    "top-labels-rank-ties": ("kernels/ctc_frame.cu", "rank += candidates[other] > key;", "rank += candidates[other] >= key;"),
    "top-labels-no-overflow-fallback": ("kernels/ctc_frame.cu", "if (num_candidates <= TOP_LABELS_CAP) {", "if (true) {"),
    "top-labels-no-syncwarp": ("kernels/ctc_frame.cu", "            __syncwarp();\n", ""),
    "top-labels-candidate-slot": ("kernels/ctc_frame.cu", "__popc(ballot & ((1u << lane) - 1u))", "__popc(ballot & (1u << lane))"),
    "top-labels-fallback-rounds": ("kernels/ctc_frame.cu", "for (int round = 0; round < P; ++round) {\n        const unsigned long long winner = warp_max_u64",
                                   "for (int round = 0; round < P - 1; ++round) {\n        const unsigned long long winner = warp_max_u64"),
    "label-step-carried-emits": ("kernels/label_step.cu", "const long long label = alive && !was_ended ? v : -1;",
                                 "const long long label = alive ? v : -1;"),
    "label-step-terms-unscaled": ("kernels/label_step.cu", "__fmul_rn(value(s, at), scale[s])", "value(s, at)"),
    "label-step-logp-half-as-float": ("kernels/label_step.cu", "(logp_half >> s) & 1", "0"),
    "label-step-terms-half-as-float": ("kernels/label_step.cu", "load_score(term[s], at, (half >> s) & 1)",
                                       "load_score(term[s], at, 0)"),
    "half-exponent-bias": ("kernels/search_math.cuh", "(exponent + 112u) << 23", "(exponent + 111u) << 23"),
    "half-subnormal-exponent": ("kernels/search_math.cuh", "(113u - shift) << 23", "(114u - shift) << 23"),
    "label-step-lane-first-term-unscaled": ("kernels/label_step.cu", "float total = __fmul_rn(loaded[k][0], terms.scale[0]);",
                                            "float total = loaded[k][0];"),
    "label-step-lane-last-label-clamp": ("kernels/label_step.cu", "(int)threadIdx.x, vocab_size - 1);",
                                         "(int)threadIdx.x, vocab_size - 2);"),
    "label-step-segment-gap": ("kernels/label_step.cu", "(blockIdx.x % segments) * LABEL_SEGMENT;",
                               "(blockIdx.x % segments) * (LABEL_SEGMENT + 1);"),
    "label-step-ended-every-segment": ("kernels/label_step.cu", "keys[r] = first_label == 0 && r < vocab_size ?",
                                       "keys[r] = r < vocab_size ?"),
    "label-step-ended-unnormalised": ("kernels/label_step.cu",
                                      "const float rank = norm != nullptr ? lane_score / lane_norm : lane_score;",
                                      "const float rank = lane_score;"),
    "label-step-no-deadline": ("kernels/label_step.cu", " || deadline[lane] <= step;", ";"),
    "label-step-term-row-ignored": ("kernels/label_step.cu", "((row >> s) & 1) ? (long long)v : row_start + v",
                                    "row_start + v"),
    "label-step-logp-row-ignored": ("kernels/label_step.cu", "((logp_row >> s) & 1) ? (long long)v : parent * vocab_size + v",
                                    "parent * vocab_size + v"),
    # robustness of the harness itself: a crash, a deadlock, an endless loop must FAIL (not hang)
    "crash-trace-oob": ("kernels/emission_tree.cu", "n = node_parent[n];", "n = node_parent[n + 100000000000LL];"),
    "deadlock-divergent-barrier": ("kernels/ctc_frame.cu", "            s_tie[j] = tie;\n", "            s_tie[j] = tie;\n            __syncthreads();\n"),
    "endless-full-scan": ("kernels/block_top_beam.cuh", "v < vocab_size; v += THREADS", "v < vocab_size; v += 0"),
    "blank-only-frame-inactive": ("kernels/ctc_frame.cu", "cur.blank[i_own] = total + (frame.active ? frame.row[blank] : 0.0f);",
                                  "cur.blank[i_own] = total + frame.row[blank];"),
    "shared-row-overrun": ("kernels/ctc_frame.cu", "v < vocab_size; v += CTC_THREADS) s_row[v] = frame.row[v];",
                           "v <= vocab_size; v += CTC_THREADS) s_row[v] = frame.row[v];"),
    "driver-int64-num-top": ("gpudecode/search/ctc_frame.py", "top_values, np.int32(num_top)", "top_values, np.int64(num_top)"),
}

def main():
    repo = Path(sys.argv[1]).resolve()
    names = sys.argv[2:] or list(MUTANTS)
    caught = 0
    for name in names:
        path, old, new = MUTANTS[name]
        text = (repo / path).read_text()
        if text.count(old) != 1:
            print(f"SKIP  {name}: pattern occurs {text.count(old)} times in {path}")
            continue
        dest = HERE / "mut" / name
        shutil.rmtree(dest, ignore_errors=True)
        for part in ("gpudecode", "kernels", "tests"):
            shutil.copytree(repo / part, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
        (dest / "examples").mkdir()  # the tests' helpers import examples/custom_scorer.py
        shutil.copy(repo / "examples" / "custom_scorer.py", dest / "examples")
        (dest / path).write_text(text.replace(old, new))
        t0 = time.time()
        res = subprocess.run([str(HERE / "run.sh"), str(dest)], capture_output=True, text=True)
        lines = res.stdout.splitlines()
        fails = [l for l in lines if l.startswith("FAIL")]
        detail = next((l.strip() for l in lines if l.startswith("        ")), "")
        verdict = "CAUGHT" if res.returncode and fails else "MISSED"  # no failing case: the harness broke
        caught += verdict == "CAUGHT"
        print(f"{verdict}  {name}: rc {res.returncode}, {len(fails)} failing cases ({time.time() - t0:.0f} s)"
              + (f"\n        first: {fails[0][6:]}\n        {detail[:300]}" if fails else "")
              + ("" if res.returncode else f"\n        {lines[-1] if lines else res.stderr[-300:]}"), flush=True)
    print(f"{caught}/{len(names)} mutants caught")

main()
