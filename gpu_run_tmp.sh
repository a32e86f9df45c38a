set -x
pip install --no-deps --no-index .whl/*.whl -q 2>&1 | tail -2
pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -2
python -c "import gymnasium, jsonschema, httpx, asyncio_throttle, tokenizers, megatron.core; print('deps ok')" 2>&1 | tail -1
nvidia-smi -L
python - <<'PY'
import yaml, sys
sys.path.insert(0, "tests")
from test_megatron_train import CONFIG
yaml.safe_dump(CONFIG, open("/tmp/cfg.yaml", "w"))
PY
export PYTHONWARNINGS=ignore
python -m miles.cli train --config /tmp/cfg.yaml --backend megatron --output-dir $OUT/run 2>&1 | grep -v -i "warn" | tail -25
python -m miles.cli train --config /tmp/cfg.yaml --backend megatron --output-dir $OUT/run32 --set trainer.precision=fp32 2>&1 | tail -4
python - <<'PY'
import json, os
for d in ("run", "run32"):
    p = os.path.join(os.environ["OUT"], d, "metrics.jsonl")
    if os.path.exists(p):
        for l in open(p):
            r = json.loads(l)
            if r["kind"] in ("train", "sync"): print(d, r["kind"], r["step"], r.get("version"), r.get("mismatch_abs"), r.get("grad_norm"))
PY
rm -rf $OUT/run*/checkpoints $OUT/run*/*.png
