#!/usr/bin/env bash
# Build the offline English corpus for minagent's BPE: the WordNet glosses.
#
#   bash experiments/data/make_corpus.sh        # ~10 s, needs apt (no root, no hub)
#
# Debian's `wordnet-base` package holds WordNet 3.0's data files; each synset line
# ends with its gloss after " | " ("a domesticated carnivorous mammal ...; \"the dog
# barked\""). We download the .deb (not installed: `dpkg -x` unpacks it into a
# temp dir), keep one gloss per line, and split them:
#
#   experiments/data/wordnet.txt          every gloss except every 50th  (~9 MB)
#   experiments/data/wordnet_heldout.txt  every 50th gloss (never in the training file),
#                                         used later to measure loss on unseen prose
#
# Licence: WordNet 3.0 licence (permissive, BSD-like), see the package's copyright file.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

cd "$tmp"
if ! apt-get download wordnet-base >/dev/null 2>&1; then
    apt-get update >/dev/null 2>&1 || true          # a fresh machine may have no package lists yet
    apt-get download wordnet-base >/dev/null
fi
dpkg -x wordnet-base_*.deb root
wn="$tmp/root/usr/share/wordnet"

# Synset lines start with their byte offset (a digit); the licence header lines start
# with two spaces. The gloss is everything after the first "|" (synset fields never
# hold one); data lines end with two spaces, which we strip.
grep -h '^[0-9]' "$wn"/data.noun "$wn"/data.verb "$wn"/data.adj "$wn"/data.adv \
    | sed -e 's/^[^|]*| //' -e 's/[[:space:]]*$//' \
    | awk -v train="$here/wordnet.txt" -v held="$here/wordnet_heldout.txt" \
          'NR % 50 == 0 { print > held; next } { print > train }'

wc -lc "$here/wordnet.txt" "$here/wordnet_heldout.txt"
