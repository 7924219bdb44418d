#!/usr/bin/env bash
# Copies the prepared TFDS C4 dataset (en, 3.0.1) from the public bucket into your bucket, for
#   python3 MaxText/train.py ... dataset_type=tfds dataset_path=gs://<your bucket> dataset_name=c4/en:3.0.1
# Usage: bash download_dataset.sh <gcp project to bill> gs://<your bucket>
set -euo pipefail
if [[ $# -ne 2 || "$2" != gs://* ]]; then
  echo "usage: bash download_dataset.sh <gcp project to bill> gs://<your bucket>" >&2
  exit 2
fi
command -v gsutil >/dev/null || { echo "download_dataset.sh: gsutil is not installed (Google Cloud SDK)" >&2; exit 2; }
gsutil -u "$1" -m cp 'gs://allennlp-tensorflow-datasets/c4/en/3.0.1/*' "$2/c4/en/3.0.1"
