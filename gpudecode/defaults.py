"""Every default value and every set of valid choices, in one place.

The YAML schema (`gpudecode.config`) and the command line (`gpudecode.cli`) both read these
names, so a default changes here and nowhere else. Units are in the names (``*_ms``, ``*_hz``,
``*_bytes``).
"""

from __future__ import annotations

# --- runtime -------------------------------------------------------------------------------
DEVICES = ("cpu", "cuda")
DEVICE = "cpu"
DEVICE_ID = 0
TF32 = False  # TF32 off by default: CUDA results equal the CPU's only with TF32 off
#: ONNX Runtime's XQA kernel for GroupQueryAttention's decoding steps over a shared past/present
#: (ORT_ENABLE_XQA): off — on the H200 it took 4× the attention time of a 512-row beam step (6×512
#: GPT-2: 772 against 181 µs per step) and rounds float16 otherwise than the unshared form
GQA_XQA = False
CUDA_GRAPHS = "auto"  # "auto": on with runtime.device cuda (off, with a warning naming why, where a model cannot be captured)
GRAPHS_ENABLED = False  # a scorer built from the Python API (GraphOptions) captures graphs only when asked
GRAPH_TIME_STEP = 32  # history buckets: powers of two up to this, then multiples of it
GRAPH_MIN_ROWS = 8  # the smallest row bucket
GRAPH_SHARED_BUFFERS = True  # one buffer per tensor name across buckets (SGLang's trick)
GRAPH_WARM_UP_TIME = 0  # 0: capture lazily; else every history bucket up to this at the start
GRAPH_RESIDENT_GREEDY = True  # greedy steps keep their states in the captured step's inputs
GRAPH_SHARED_PRESENTS = True  # GroupQueryAttention's presents bound to their pasts' buffers (appended in place)
ORT_ARENA_LIMIT_BYTES: int | None = None  # None: no limit
CUPY_POOL_LIMIT_BYTES: int | None = None  # CuPy's device memory pool, the process's; None: no limit
CUDNN_CONV_ALGO_SEARCHES = ("EXHAUSTIVE", "HEURISTIC", "DEFAULT")
# HEURISTIC, not ONNX Runtime's EXHAUSTIVE: decoding sees many shapes, and an exhaustive search
# per new shape costs more than it saves.
CUDNN_CONV_ALGO_SEARCH = "HEURISTIC"
PREFETCH_BATCHES = 2  # batches read (and through the front end) ahead in a thread; 0: no thread
WRITER_QUEUE = 256  # results queued for the writer thread; 0: written in the decoding loop
# results formatted and written by a child process (``gpudecode.io.writer_process``): "auto" is on
# for runtime.device cuda, where the decoding loop needs the GIL between short GPU waits
WRITER_PROCESS = "auto"
# utterances formatted and flushed at a time: each flush gives up the GIL, so a decoding loop that
# gave it up (a GPU wait, an ONNX Runtime run) gets it back within one chunk's formatting (~0.3 ms),
# not after the interpreter's 5 ms switch interval (tools/gil-handover)
WRITE_CHUNK = 8
# decoding processes sharing the device (``gpudecode.engines.processes``); 1: this process alone.
# Not more by default: on one H200 four processes made the joint CTC/attention system 2.5x slower
# (its many short kernels of four processes take turns on the GPU) while the others gained up to
# 1.8x (docs/performance.md, "End to end")
PROCESSES = 1
BATCHES_PER_PROCESS = 4  # a run on several processes cuts its batches so that each gets this many

# --- models: front end (log-mel features from audio) ---------------------------------------
SAMPLE_RATE_HZ = 16000
WINDOW_MS = 25.0
HOP_MS = 10.0
FFT_SIZE: int | None = None  # None: the next power of two >= the window length in samples
NUM_MEL_BINS = 80
LOW_FREQ_HZ = 20.0
HIGH_FREQ_HZ: float | None = None  # None: the Nyquist frequency
LOG_FLOOR = 1e-10
WINDOW_TYPES = ("hann", "hamming", "povey", "rectangular")
WINDOW_TYPE = "hann"
PREEMPHASIS = 0.0  # 0: off
NORMALISATIONS = ("none", "utterance", "global")
NORMALISATION = "none"

# --- scorers ---------------------------------------------------------------------------------
# Built-in scorer types; any other type must be a ``module:Class`` import path.
BUILTIN_SCORER_TYPES = (
    "onnx-decoder",
    "prefix-lm",
    "recurrent-lm",
    "ctc-prefix",
    "length-reward",
    "suppress-tokens",
)
SCORER_SCALE = 1.0
SCORES_KINDS = ("log-probs", "neg-log-probs", "logits")
SCORES_KIND = "log-probs"
STATE_MANAGER_TYPE = "transformer"  # the types: gpudecode.states.options.STATE_MANAGER_TYPES
MAX_HISTORY: int | None = None  # None: keep every token state
ALWAYS_INCLUDE_FIRST_TOKEN_STATE = False
SLOTS_PER_CHUNK = 1024
STORAGE_DTYPES = ("model", "float32", "float16")
STORAGE_DTYPE = "model"  # "model": store states in the model's own dtype
STATE_COMPRESSIONS = ("none", "fixed-quantisation", "reduced-precision")
STATE_COMPRESSION = "none"

# --- search ----------------------------------------------------------------------------------
RECOMBINATIONS = ("sum", "max")  # transducer: how equal label sequences are merged
RECOMBINATION = "sum"
SEARCH_TYPE = "label-sync"
BEAM_SIZE = 8
NBEST: int | None = None  # None: every hypothesis of the final beam
SCORE_THRESHOLD: float | None = None  # None: no threshold pruning
LENGTH_NORM_SCALE = 1.0  # ranking by score / length**scale; 0 turns it off
MAX_LABELS_PER_INPUT = 1.0  # labels per encoder frame (label-synchronous search)
MAX_LABELS = 1024  # absolute cap per utterance
# utterances read and handed to one search call (search.batch_size unset): on the CPU, and on CUDA,
# where a search step costs about as much for 1,024 utterances as for 16 (a step out of memory is split)
SEARCH_BATCH_SIZE = 16
SEARCH_BATCH_SIZE_CUDA = 1024
# padded input frames per search call (batch utterances x its longest; search.batch_frames unset):
# on CUDA long utterances come in smaller batches (30 s Whisper windows: 87 a batch), none on the CPU
SEARCH_BATCH_FRAMES: int | None = None
SEARCH_BATCH_FRAMES_CUDA = 262_144
# on CUDA with search.batch_size unset, the first batch holds at most this many utterances, so the
# first results come early (the search's one-time set-up runs on a small batch)
SEARCH_FIRST_BATCH_SIZE_CUDA = 32
# Continuous batching: lane groups in flight within one search call (None: all of the batch at once,
# static batching); finished utterances' groups are refilled from the batch in this order.
MAX_ACTIVE_UTTERANCES = None
ADMISSION_ORDERS = ("longest-first", "shortest-first", "input")
ADMISSION_ORDER = "longest-first"
MAX_CACHED_SCORE_VECTORS = 10_000
PRE_BEAM_SIZE: int | None = None  # None: no pre-pruning, every label is a candidate
MAX_SYMBOLS_PER_FRAME = 10  # transducer (NeMo's default)
# label-sync search semantics (the peers' generate options; defaults: today's search)
MIN_LENGTH = 0  # sentence-end masked while a hypothesis has fewer labels
FINISHED_MODES = ("in-beam", "separate", "separate-genai")  # where terminated hypotheses live
FINISHED = "in-beam"
EARLY_STOPPING_MODES = (True, False, "never")  # finished "separate": when an utterance stops
EARLY_STOPPING: bool | str = False
LENGTH_COUNTS = ("labels", "prompt-and-labels")  # what the length normaliser counts
LENGTH_COUNT = "labels"
# search.tuning (speed only, never the results; see gpudecode.search.tuning)
STOP_TEST_LAG = 2  # the label-sync stop test is read this many steps late (on CuPy)
STOP_TEST_EVERY = 1  # ... and posted every this many steps
HOST_WAIT_MODES = ("block", "spin", "nap")
HOST_WAIT = "nap"  # poll and sleep between polls
HOST_WAIT_NAP_S = 100e-6  # a napping wait's first sleep ...
HOST_WAIT_MAX_NAP_S = 1e-3  # ... doubling up to this
CPU_THREADS = 1  # the compiled CTC loop's threads (1: the calling thread alone)

# --- io --------------------------------------------------------------------------------------
FEATURE_FORMATS = ("auto", "npy-dir", "npz", "hdf5", "kaldi-ark", "kaldi-scp", "audio")
FEATURE_FORMAT = "auto"
AUDIO_EXTENSIONS = (".wav", ".flac")
OUTPUT_FOLDER = "output"
OUTPUT_FORMAT_CHOICES = ("text", "jsonl", "ctm")
OUTPUT_FORMATS = ("text", "jsonl")
WORD_MERGINGS = ("none", "sentencepiece", "bpe")
WORD_MERGING = "none"
ON_BAD_INPUT_CHOICES = ("stop", "skip")
ON_BAD_INPUT = "stop"
PROMPT_FORMATS = ("ids", "text")  # io.prompts_format: label indices, or labels looked up in the vocabulary
PROMPT_FORMAT = "ids"

# File names inside the output folder.
TEXT_FILE = "text"
JSONL_FILE = "nbest.jsonl"
CTM_FILE = "hyp.ctm"
WER_FILE = "wer.json"
RESOLVED_CONFIG_FILE = "config.resolved.yaml"
IDENTITY_FILE = "run-identity.json"  # what produced the results: checked by --resume (gpudecode.io.identity)

# --- engine: where decoding runs ------------------------------------------------------------
ENGINES = ("local", "ray")
ENGINE = "local"  # local: this process; ray: a pool of decoder actors on a Ray cluster
# None: RAY_ADDRESS, else the latest cluster started on this machine (`ray start`), else a new
# local one; "local": always a new local one; "auto": an existing one or an error.
ENGINE_ADDRESS: str | None = None
ENGINE_WORKERS: int | None = None  # None: as many as the cluster's GPUs (or CPUs) allow
GPUS_PER_WORKER: float | None = None  # None: 1 with runtime.device=cuda, else 0
CPUS_PER_WORKER = 1.0
BATCHES_PER_SHARD = 4  # search batches per shard: the unit decoded again after a worker dies
WORKER_MAX_RESTARTS = -1  # a dead worker is restarted; -1: without limit
SHARD_MAX_RETRIES = 3  # a shard whose worker died is decoded again at most this often
