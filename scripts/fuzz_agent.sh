#!/usr/bin/env bash
# Agent-level fuzzing, longer than CI runs it (tests/test_fuzz_agent.py): the
# real agent against the fake API server, NftBackend in a throwaway network
# namespace, random valid and invalid Services, EndpointSlices and Node
# updates in batches; after each batch the kernel table must equal one full
# sync of the valid objects, nothing may have crashed, and every invalid
# field must have been reported once (tests/fuzz_agent.py says how).
# Needs root. Arguments go to tests/fuzz_agent.py:
#   --batches N (200)  --size WRITES_PER_BATCH (30)  --services N (12)  --seed S (random)
# It prints the seed first; a failure prints the batch's writes and the
# command that reproduces it, and exits 1.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$here/scripts/setup.sh"
cd "$here"
exec .venv/bin/python tests/fuzz_agent.py "$@"
