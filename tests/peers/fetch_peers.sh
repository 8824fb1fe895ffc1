#!/bin/sh
# make peers-fetch: put the peers' test files, at pinned versions, into PEERS_DIR ($1), and
# the packages only their tests import into PEERS_DIR/site. Needs the network once;
# `make test-peers` then reads PEERS_DIR only. These files are the peers' (Apache-2.0):
# they stay out of this repository.
set -eu
PEERS_DIR=${1:?usage: fetch_peers.sh PEERS_DIR}
mkdir -p "$PEERS_DIR"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

sparse() {  # sparse(repo, ref, dest, paths...): those paths of repo at ref into dest
    repo=$1 ref=$2 dest=$3
    shift 3
    git -C "$tmp" init -q "$dest"
    git -C "$tmp/$dest" remote add origin "https://github.com/$repo"
    git -C "$tmp/$dest" sparse-checkout set --no-cone "$@"
    git -C "$tmp/$dest" fetch -q --depth 1 --filter=blob:none origin "$ref"
    git -C "$tmp/$dest" checkout -q FETCH_HEAD
    rm -rf "${PEERS_DIR:?}/$dest"
    mkdir -p "$PEERS_DIR/$dest"
    cp -r "$tmp/$dest/." "$PEERS_DIR/$dest/"
    rm -rf "$PEERS_DIR/$dest/.git"
}

# transformers 5.24: the DeepSpeed trainer tests and what they import
sparse huggingface/transformers 0a5ecfb6e41ac6a2ed5b44358ca9bfde2d46afd2 transformers \
    /tests/__init__.py /tests/trainer/__init__.py /tests/trainer/trainer_test_utils.py \
    /tests/trainer/distributed/ /tests/fixtures/tests_samples/SQUAD/
# accelerate 1.15: tests/deepspeed and the samples and configs it reads
sparse huggingface/accelerate v1.15.0 accelerate /tests/
# ... and the package beside them, laid out as accelerate's own CI has it (a checkout with
# src/accelerate): test_ds_multiple_model.py finds tests/deepspeed/*.json six directories
# above its own file. The same release as the venv's accelerate, from the package index.
"${PYTHON:-python3}" -m pip install -q --target "$PEERS_DIR/accelerate/src" --no-deps accelerate==1.15.0
# DeepSpeed 0.16.5: tests/ (the runner collects 33 files of tests/unit/runtime)
sparse deepspeedai/DeepSpeed v0.16.5 deepspeed /tests/

# packages the tests import that zeroshard's venv does not carry
"${PYTHON:-python3}" -m pip install -q --target "$PEERS_DIR/site" --no-deps \
    datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 pandas==3.1.1 \
    parameterized==0.9.0 pyarrow==26.0.1 sentencepiece==0.2.3 hjson==3.1.0 mup==1.0.0 \
    optuna==5.0.0 alembic==1.20.1 sqlalchemy==2.1.9 colorlog==6.12.0 mako==1.4.3 greenlet==3.5.6 \
    evaluate==0.4.6
echo "fetch_peers: $PEERS_DIR ready"
