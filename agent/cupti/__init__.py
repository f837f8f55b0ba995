"""The CUPTI library a CUDA workload loads with CUDA_INJECTION64_PATH: its C sources live here (README.md);
scripts/build_cupti.sh builds libfleetprof_cupti.so from them, and agent/gpu/cupti_ring.py reads its ring."""

from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
LIBRARY_FILE = "libfleetprof_cupti.so"
