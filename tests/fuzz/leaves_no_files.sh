#!/bin/sh
# The replayer, given a TMPDIR of its own, writes its scratch run.db there and nowhere else,
# and leaves nothing behind when it exits (each run used to leave /tmp/ampdiag-fuzz-PID.db).
# usage: leaves_no_files.sh REPLAYER INPUT...
set -eu
replayer=$1
shift
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
TMPDIR=$tmp "$replayer" "$@" >/dev/null &
pid=$!
wait "$pid"
if [ -e "/tmp/ampdiag-fuzz-$pid.db" ]; then
  echo "the replayer (pid $pid) left /tmp/ampdiag-fuzz-$pid.db behind" >&2
  rm -f "/tmp/ampdiag-fuzz-$pid.db"
  exit 1
fi
left=$(ls -A "$tmp")
if [ -n "$left" ]; then
  echo "the replayer left in its TMPDIR: $left" >&2
  exit 1
fi
echo "no files left behind"
