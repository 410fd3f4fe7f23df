set -uo pipefail
bash scripts/device_check.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 230 python3 benchmarks/tracer_ablation.py --device cuda --rounds 2 --steps 3 \
  --workloads gpt,llama --conditions module_statistics,op_statistics,op_tensor_async \
  --devices triton_stats,file_process > $OUT/ablation_cuda.json 2> $OUT/ablation_cuda.err
echo "ablation exit $?"
python3 -c "
import json; d=json.load(open('$OUT/ablation_cuda.json')); print(json.dumps({k: d[k] for k in ('workloads','overhead')}))
print(json.dumps({k: v.get('best_gain_pct') for k, v in d['devices'].items()}))"
