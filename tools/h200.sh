#!/bin/bash
# Runs the GPU checks and the benchmark on the GPU machine (H200) from the bundle (.gpu/).
#   here:   tools/h200.sh --pack        builds .gpu/ (tools/gpu-bundle.sh: plugin, tests, bench,
#                                       GStreamer runtime, frei0r's cartoon filter)
#   there:  source .gpu/env.sh && tools/h200.sh <step...>
#           steps: parity fast-parity report fast-report element faults soak bench real overlap
#                  neural-bench neural-speed neural-ab peer stats sanitize
# Writes logs under $OUT when set.
set -uo pipefail
if [ "${1:-}" = "--pack" ]; then
    shift
    exec "$(dirname "$0")/gpu-bundle.sh" "$@"
fi
export FREI0R_PATH=${FREI0R_PATH:-$PWD/.gpu/frei0r}
export CARGO_MANIFEST_DIR=$PWD
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
rc=0
# The models of the neural steps: the generated Hayao-class network (written here by the
# bundled neural_peer_models test) and TOONFLOW_PEER_MODELS="a.onnx ..." (e.g. a local AnimeGANv3
# copied into .gpu/ for the run; its weights are non-commercial, never committed).
neural_models() {
    local dir=/tmp/toonflow-peer-models
    [[ -f $dir/hayao_class.onnx ]] || for t in .gpu/tests/neural_peer_models-*; do
        TOONFLOW_PEER_MODEL_DIR=$dir "$t" >/dev/null
    done
    echo ${TOONFLOW_PEER_MODELS:-} $dir/hayao_class.onnx
}
for step in "$@"; do
    echo "=== $step"
    case $step in
        parity) for t in .gpu/tests/cuda_parity-*; do "$t" --nocapture --test-threads=1 2>&1 | tee -a "$out/parity.log" || rc=1; done ;;
        fast-report) for t in .gpu/tests/cuda_report-*; do TOONFLOW_FAST_MATH=1 "$t" --nocapture --test-threads=1 timings 2>&1 | tee -a "$out/report-fast.log" || rc=1; done ;;
        fast-parity) for t in .gpu/tests/cuda_parity-*; do TOONFLOW_FAST_MATH=1 "$t" --nocapture --test-threads=1 2>&1 | tee -a "$out/parity-fast.log" || rc=1; done ;;
        report) for t in .gpu/tests/cuda_report-*; do "$t" --nocapture --test-threads=1 2>&1 | tee -a "$out/report.log" || rc=1; done ;;
        element)
            for t in .gpu/tests/launch-* .gpu/tests/element-* .gpu/tests/temporal-*; do "$t" 2>&1 | tail -3; done
            TOONFLOW_TEST_BACKEND=cuda .gpu/tests/hardening-* --nocapture --skip soak 2>&1 | tee -a "$out/hardening.log" | grep -E "^test |RSS|result|panicked" || rc=1 ;;
        faults) for t in .gpu/tests/cuda_faults-*; do "$t" --nocapture --test-threads=1 2>&1 | tee -a "$out/faults.log" || rc=1; done ;;
        soak) TOONFLOW_TEST_BACKEND=cuda .gpu/tests/hardening-* --nocapture soak 2>&1 | tee -a "$out/soak.log" | grep -E "soak|result|panicked" || rc=1 ;;
        bench) .gpu/bin/toonflow-bench --sizes 720p,1080p,1440p,4k --modes cuda-eager,cuda-graph,frei0r \
                   --precisions fp16,fp32 --frames 2000 --cpu-frames 3 --reps 3 --json "$out/bench.json" 2>&1 | tee "$out/bench.txt" || rc=1 ;;
        real) # issue 12: the pipelines people run, density, host-copy paths (1080p)
            .gpu/bin/toonflow-bench --sizes 1080p --precisions fp16 --frames 1000 --reps 3 \
                --modes videotestsrc,rawvideoparse,rawvideoparse-only,appsrc-pinned,appsrc-pageable,appsrc-fresh,nvh264dec,nvh264dec-cudadownload,nvh264dec-cuda,nvh264dec-only,nvh264dec-cudadownload-only,nvh264dec-cuda-only,density,host-copies \
                --json "$out/real.json" 2>&1 | grep -v XDG_RUNTIME | tee "$out/real.txt" || rc=1 ;;
        overlap) # issue 12's overlap path: off and on side by side, flat out and paced below capacity
            .gpu/bin/toonflow-bench --sizes 1080p --precisions fp16 --frames 1000 --reps 3 --overlap off,on \
                --modes rawvideoparse,rawvideoparse-only,appsrc-fresh,appsrc-pinned,appsrc-pageable,videotestsrc \
                --json "$out/overlap.json" 2>&1 | grep -v XDG_RUNTIME | tee "$out/overlap.txt" || rc=1
            .gpu/bin/toonflow-bench --sizes 1080p --precisions fp16 --frames 1000 --reps 3 --overlap off,on --pace 1500 \
                --modes appsrc-fresh,appsrc-pinned,appsrc-pageable \
                --json "$out/overlap-paced.json" 2>&1 | grep -v XDG_RUNTIME | tee "$out/overlap-paced.txt" || rc=1 ;;
        peer) # the PyTorch peer on the generated Hayao-class model and TOONFLOW_PEER_MODELS
            python3 tools/peers/torch_peer.py $(neural_models) \
                --json "$out/peer.jsonl" 2>&1 | tee "$out/peer.txt" || rc=1 ;;
        neural-bench) # toonflow's network on the GPU, same models, 720p/1080p/4K
            for m in $(neural_models); do
                .gpu/bin/toonflow-bench --model "$m" --modes cuda-eager,cuda-graph --precisions fp16,fp32 \
                    --frames "${TOONFLOW_NEURAL_FRAMES:-200}" --reps 1 --json "$out/neural-bench-$(basename "$m" .onnx).json" \
                    2>&1 | tee -a "$out/neural-bench.txt" || rc=1
            done ;;
        sanitize) # compute-sanitizer memcheck and racecheck over the kernel-running tests
            for t in .gpu/tests/neural_cuda-* .gpu/tests/cuda_parity-* .gpu/tests/cuda_memory-*; do
                for tool in memcheck racecheck; do
                    echo "--- $tool ${t##*/}"
                    # (--report-api-errors no: the element asks the driver whether a host buffer is
                    # pinned, cuMemHostGetFlags / cuPointerGetAttribute, and "invalid value" is the
                    # answer "pageable"; memcheck counted each as an error, 176 in neural_cuda)
                    compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 99 --print-limit 20 \
                        "$t" --test-threads=1 ${TOONFLOW_SANITIZE_FILTER:-} >"$out/sanitize-$tool-${t##*/}.log" 2>&1
                    code=$?
                    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test result" "$out/sanitize-$tool-${t##*/}.log"
                    ((code == 0)) || { echo "exit $code"; rc=1; }
                done
            done ;;
        neural-speed) # the network's launches alone (graph replay), the generated models, the real
            # tiny when TOONFLOW_ANIMEGAN_DIR holds it, and hayao_class; 720p/1080p/4K
            for t in .gpu/tests/neural_cuda-*; do TOONFLOW_NEURAL_BENCH=1 "$t" --nocapture --test-threads=1 speed 2>&1 |
                tee -a "$out/neural-speed.txt" | grep -E "ms/frame|panicked" || rc=1; done ;;
        neural-ab) # the kernel switches off and on, side by side, three rounds (ABAB...): the
            # compiled shapes (TOONFLOW_NEURAL_3X3), the paired output convolution
            # (TOONFLOW_NEURAL_PAIRED) and the affine chains in the gathers
            # (TOONFLOW_NEURAL_PROLOGUE), the staged Resize patch (TOONFLOW_NEURAL_PATCH), the
            # double-buffered gathers (TOONFLOW_NEURAL_PIPELINE, TOONFLOW_NEURAL_PIPELINE_CL,
            # TOONFLOW_NEURAL_PIPELINE_PATCH) and the patch at four tiles
            # (TOONFLOW_NEURAL_NARROW_PATCH), the activation after a folded residual Add
            # (TOONFLOW_NEURAL_RESIDUAL_ACT), the residual-pair epilogue
            # (TOONFLOW_NEURAL_RESIDUAL_PAIRS) and the 7x7 kernels' tall blocks
            # (TOONFLOW_NEURAL_TALL);
            # TOONFLOW_NEURAL_AB picks the model and size
            for t in .gpu/tests/neural_cuda-*; do
                for round in 1 2 3; do
                    for sw in "TOONFLOW_NEURAL_3X3=0 TOONFLOW_NEURAL_PAIRED=0 TOONFLOW_NEURAL_PROLOGUE=0 TOONFLOW_NEURAL_PATCH=0 TOONFLOW_NEURAL_PIPELINE=0 TOONFLOW_NEURAL_PIPELINE_CL=0 TOONFLOW_NEURAL_PIPELINE_PATCH=0 TOONFLOW_NEURAL_NARROW_PATCH=0 TOONFLOW_NEURAL_RESIDUAL_ACT=0 TOONFLOW_NEURAL_RESIDUAL_PAIRS=0 TOONFLOW_NEURAL_TALL=0" "TOONFLOW_NEURAL_3X3=0" "TOONFLOW_NEURAL_PAIRED=0" "TOONFLOW_NEURAL_PROLOGUE=0" "TOONFLOW_NEURAL_PATCH=0" "TOONFLOW_NEURAL_PIPELINE=0" "TOONFLOW_NEURAL_PIPELINE_CL=0" "TOONFLOW_NEURAL_PIPELINE_PATCH=0" "TOONFLOW_NEURAL_NARROW_PATCH=0" "TOONFLOW_NEURAL_RESIDUAL_ACT=0" "TOONFLOW_NEURAL_RESIDUAL_PAIRS=0" "TOONFLOW_NEURAL_TALL=0" "TOONFLOW_NEURAL_AB_ALL=1"; do
                        printf '%s round %s: ' "$sw" "$round"
                        env $sw TOONFLOW_NEURAL_BENCH=${TOONFLOW_NEURAL_AB:-tiny_Cute:1080p} "$t" --nocapture \
                            --test-threads=1 speed 2>&1 | grep -E "ms/frame|panicked" | tr '\n' ' '
                        echo
                    done
                done | tee -a "$out/neural-ab.txt"
            done ;;
        stats) gst-launch-1.0 -m videotestsrc num-buffers=300 ! video/x-raw,format=NV12,width=1920,height=1080 ! \
                   toonflow stats-interval=100 ! fakesink 2>&1 | grep -E "toonflow-stats" | tail -2 ;;
    esac
done
exit $rc
