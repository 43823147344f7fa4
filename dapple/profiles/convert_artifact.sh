#!/usr/bin/env bash
# Regenerates profiles/artifact/*.json from the DAPPLE artifact's text profiles.
# Usage: bash profiles/convert_artifact.sh [ARTIFACT_DIR [OUT_DIR]]
#   defaults: ../shared/profiles/dapple-artifact and profiles/artifact
# The batch size is the one in each file name (pbs-N); optimizers are the paper's (section VI-A); the
# artifact's AmoebaNet code builds tf.train.RMSPropOptimizer(momentum=0.9), two state slots per weight.
# The last column, where given, is the paper's Table II memory of one GPU training the whole model at
# that batch size (GB read as GiB); it calibrates the bytes each layer keeps for backward (docs/cost-model.md).
# GNMT-16's 3.9 GB is below its own Adam model state (4.3 GiB), so it cannot calibrate and is left out.
set -euo pipefail
src=${1:-../shared/profiles/dapple-artifact}
out=${2:-$(dirname "$0")/artifact}
mkdir -p "$out"
origin() { echo "DAPPLE artifact, AlibabaPAI/DAPPLE profiling_results/$1 (BSD-3-Clause): measured by the DAPPLE authors on NVIDIA V100 16GB"; }
convert() { # file model batch optimizer pattern [scale] [measured peak GiB]
  local file=$1 model=$2 batch=$3 opt=$4 pattern=$5 scale=${6:-1.0} peak=${7:-}
  local name; name=$(echo "$file" | sed 's/\.txt$//')
  dapple profile import-artifact "$src/$file" --model "$model" --batch-size "$batch" --optimizer "$opt" \
    ${pattern:+--block-pattern "$pattern"} --param-bytes-scale "$scale" --device V100-16GB \
    ${peak:+--measured-peak-memory-gib "$peak"} --origin "$(origin "$file")" --out "$out/$name.json"
}
convert gnmt-16-pbs-64.txt             GNMT-16      64 adam    'LSTM|RecurrentAttention'
convert gnmt-32-pbs-64.txt             GNMT-32      64 adam    'LSTM|RecurrentAttention'
convert gnmt-32-pbs-64-simplified.txt  GNMT-32      64 adam    'LSTM|RecurrentAttention'
convert bert-48-pbs-2.txt              BERT-48       2 adam    '^layer_\d+$'             1.0 11.4
convert bert-24-pbs-6.txt              BERT-24       6 adam    '^layer_\d+$'
convert xlnet-36-pbs-1.txt             XLNet-36      1 adam    '^Layer_\d+$'             1.0 12
convert xlnet-24-pbs-1.txt             XLNet-24      1 adam    '^Layer_\d+$'
convert amoeba-36-pbs-1.txt            AmoebaNet-36  1 rmsprop-momentum '^cell_\d+$'     1.0 20
convert amoeba-18-pbs-8.txt            AmoebaNet-18  8 rmsprop-momentum '^cell_\d+$'
convert amoeba-6-pbs-8-simplified.txt  AmoebaNet-6   8 rmsprop-momentum '^cell_\d+$'
convert amoeba-6-pbs-8-complicated.txt AmoebaNet-6   8 rmsprop-momentum '^cell_?\d+$'
# The VGG-19 file was written by hand with parameter sizes in bytes / 1.048576.
convert vgg-19-pbs-32.txt              VGG-19       32 sgd     '^(Conv2d|FC|Prediction)' 1.048576 5.6
# No batch size in this file's name: 64, from the first ReLU's 822083584 bytes = 64 x 64ch x 224 x 224 x 4 B.
convert vgg16.txt                      VGG-16       64 sgd     '^(Conv2d|Linear)'
