# shellcheck shell=bash
# The helpers the scripts of scripts/ share, each defined once. Sourced, not
# run: a script sets LOG_TAG (the prefix of its log lines) and then
#
#   . "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
#
# which sets REPO_ROOT (the checkout's root) and makes it the working
# directory. The script keeps its own `set -euo pipefail`; nothing here
# changes shell options, and nothing is exported.
#
# Helpers:
#   log, die, now, abspath, site_packages, sha256_of   small things
#   timed, log_timings                                 steps and their seconds
#   venv_stamp, clone_venv, build_parity_venv,         venvs
#   tools_venv
#   install_blockpool                                  this checkout, editable
#   fetch_sdist (download_from_index)                  an sdist from pip's index
#   runner_pass, passed_not_in, passes_verdict         pytest passes, compared
# Some read the calling script's settings, named at each helper.
# shellcheck disable=SC2154  # VENV_PY, RESULTS_DIR, ...: the calling script's

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT" || exit 2

# log MESSAGE...: one line on stderr, "[LOG_TAG] MESSAGE".
log() { printf '[%s] %s\n' "$LOG_TAG" "$*" >&2; }
# die MESSAGE...: log "ERROR: MESSAGE" and exit 2 (the scripts' setup error).
die() { log "ERROR: $*"; exit 2; }
# now: seconds since the epoch.
now() { date +%s; }
# abspath PATH: PATH, relative ones taken from the checkout's root.
abspath() { case "$1" in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$REPO_ROOT/$1" ;; esac; }

# timed LABEL CMD...: runs CMD, then logs "LABEL: N s", keeps N in
# TIMINGS[LABEL] (LABEL appended to TIMING_ORDER) and returns CMD's exit
# status. Under `set -e` a failing CMD ends the script, as it would without
# timed, unless timed is itself tested (`if timed ...`, `timed ... ||`).
declare -A TIMINGS=()
TIMING_ORDER=()
timed() {
  local label=$1; shift
  local t0; t0=$(now)
  "$@"
  local rc=$?
  TIMINGS[$label]=$(( $(now) - t0 ))
  TIMING_ORDER+=("$label")
  log "$label: ${TIMINGS[$label]} s"
  return "$rc"
}

# log_timings START: logs "timings: LABEL Ns; ... total Ns", the steps
# timed ran in the order they ran, the total since START (seconds since the
# epoch).
log_timings() {
  local k t=""
  for k in "${TIMING_ORDER[@]}"; do t+="$k ${TIMINGS[$k]}s; "; done
  log "timings: ${t}total $(( $(now) - $1 ))s"
}

# site_packages VENV: the venv's purelib directory.
site_packages() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
# sha256_of FILE: the file's sha256, in hex.
sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

# ---------------------------------------------------------------------------
# venvs
# ---------------------------------------------------------------------------
# venv_stamp VENV: what a clone of VENV is stamped with: its requirements
# stamp (.freeze-sha256, written by scripts/vllm_parity.sh; "none" without
# one) and the mtime of its site-packages (which changes when a package is
# installed or removed). "none" when VENV has no python.
venv_stamp() {
  [[ -x "$1/bin/python" ]] || { echo none; return 0; }
  printf '%s %s\n' "$(cat "$1/.freeze-sha256" 2>/dev/null || echo none)" "$(stat -c %Y "$(site_packages "$1")")"
}

# clone_venv SRC DST: DST made anew as a hard-linked copy of the venv SRC
# (seconds, no extra disk; a plain copy where hard links fail). Nothing is
# written in place in a clone (pip and ln replace files), so SRC's files
# stay as they are. Dies unless DST then runs as a venv of its own.
clone_venv() {
  local src=$1 dst=$2
  log "cloning $src into $dst (hard links)"
  rm -rf "$dst"
  cp -al "$src" "$dst" 2>/dev/null || { rm -rf "$dst"; cp -a "$src" "$dst"; } || die "cannot copy $src to $dst"
  [[ "$(site_packages "$dst")" == "$dst"/* ]] || die "the clone $dst does not run as a venv of its own"
}

# build_parity_venv VERSION VENV [NOTE]: the vLLM parity venv of VERSION
# (0.33.0, 0.34.0) built into VENV by scripts/vllm_parity.sh with no test
# pass; NOTE (e.g. its time and size) is added to the log line. Dies when
# that script fails; the caller checks what it needs of the venv.
build_parity_venv() {
  local version=$1 venv=$2 note=${3:-}
  log "venv $venv has no vllm $version: building it with scripts/vllm_parity.sh (no test pass${note:+; $note})"
  VLLM_PARITY_VERSION="$version" VLLM_VENV="$venv" VLLM_PARITY_PASSES=" " \
    bash "$REPO_ROOT/scripts/vllm_parity.sh" || die "scripts/vllm_parity.sh could not build $venv"
}

# install_blockpool VENV PIP_LOG [MODULE]: blockpool from this checkout
# (editable, --no-deps, so that nothing else in VENV moves) and its two
# dependencies, attrs and sortedcontainers, unless VENV imports all three
# already with blockpool from this checkout. The checks run from / (from
# the checkout, blockpool would import anyway). pip's output goes to
# PIP_LOG; dies if pip fails, or if MODULE (given) does not import after
# the install.
install_blockpool() {
  local venv=$1 out=$2 module=${3:-}
  local py="$venv/bin/python"
  if (cd / && "$py" -c 'import os, sys, blockpool, attrs, sortedcontainers; sys.exit(os.path.dirname(blockpool.__file__) != sys.argv[1])' \
      "$REPO_ROOT/blockpool") >/dev/null 2>&1; then
    return 0
  fi
  log "pip install --no-deps -e $REPO_ROOT (plus attrs, sortedcontainers) into $venv"
  mkdir -p "$(dirname "$out")"
  { "$py" -m pip install --no-input --no-deps -e "$REPO_ROOT" && "$py" -m pip install --no-input attrs sortedcontainers; } \
    >"$out" 2>&1 || { tail -n 20 "$out" >&2; die "cannot install blockpool into $venv"; }
  [[ -z "$module" ]] || (cd / && "$py" -c "import $module") >/dev/null 2>&1 || die "$module does not import in $venv"
}

# tools_venv VENV REQUIREMENT...: a venv holding exactly these pinned
# requirements (a stamp file, .tools-stamp, names them; made anew when they
# change). Uses python3 (or $TOOLS_PYTHON).
tools_venv() {
  local venv=$1; shift
  local want; want="$(printf '%s\n' "$@")"
  if [[ -x "$venv/bin/python" && "$(cat "$venv/.tools-stamp" 2>/dev/null)" == "$want" ]]; then
    return 0
  fi
  log "venv $venv with $*"
  rm -rf "$venv"
  "${TOOLS_PYTHON:-python3}" -m venv "$venv" || die "cannot create $venv"
  "$venv/bin/python" -m pip install --no-input "$@" >"$venv/.tools-install.log" 2>&1 \
    || { tail -n 20 "$venv/.tools-install.log" >&2; die "pip install $* into $venv failed"; }
  printf '%s\n' "$want" >"$venv/.tools-stamp"
}

# ---------------------------------------------------------------------------
# sdists
# ---------------------------------------------------------------------------
# download_from_index PROJECT FILE DEST: FILE of PROJECT's page on pip's
# index (PIP_INDEX_URL, else pip's configured global.index-url, else pip's
# own default, asked of pip so that no host is written here; PEP 691 JSON or
# PEP 503 HTML), downloaded with the standard library to DEST (through
# DEST.part), checked against the sha256 the page lists for it. Honours
# PIP_CERT / global.cert. Returns non-zero when it cannot. Reads BASE_PYTHON
# (the interpreter that asks pip).
download_from_index() {
  local project=$1 file=$2 dest=$3
  local index cert
  index="${PIP_INDEX_URL:-$("$BASE_PYTHON" -m pip config get global.index-url 2>/dev/null || true)}"
  [[ -n "$index" ]] || index="$("$BASE_PYTHON" -c 'from pip._internal.models.index import PyPI; print(PyPI.simple_url)')"
  cert="${PIP_CERT:-$("$BASE_PYTHON" -m pip config get global.cert 2>/dev/null || true)}"
  log "fetching $file from pip's index"
  "$BASE_PYTHON" - "$index" "$cert" "$project" "$file" "$dest" <<'EOF'
import hashlib, json, os, re, ssl, sys, urllib.parse, urllib.request
index, cert, project, name, dest = sys.argv[1:]
ctx = ssl.create_default_context(cafile=cert or None)
page = index.rstrip("/") + f"/{project}/"
req = urllib.request.Request(page, headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
with urllib.request.urlopen(req, timeout=120, context=ctx) as r:
    ctype, body = r.headers.get("Content-Type", ""), r.read().decode()
url = sha = None
if "json" in ctype:
    for f in json.loads(body)["files"]:
        if f["filename"] == name:
            url, sha = f["url"], f["hashes"].get("sha256")
else:
    for href in re.findall(r'href="([^"]+)"', body):
        href = href.replace("&amp;", "&")
        if urllib.parse.urlsplit(href).path.endswith("/" + name):
            url, _, frag = href.partition("#")
            sha = frag.partition("sha256=")[2] or None
if not url:
    sys.exit(f"{name} not listed on {page}")
tmp = dest + ".part"
h = hashlib.sha256()
with urllib.request.urlopen(urllib.parse.urljoin(page, url), timeout=600, context=ctx) as r, open(tmp, "wb") as out:
    while chunk := r.read(1 << 20):
        h.update(chunk)
        out.write(chunk)
if sha and h.hexdigest() != sha:
    os.unlink(tmp)
    sys.exit(f"sha256 mismatch for {url}")
os.replace(tmp, dest)
EOF
}

# fetch_sdist PROJECT VERSION SHA256 CACHE MARKER [FALLBACK]: PROJECT's
# sdist unpacked into CACHE/PROJECT-VERSION, ready when that tree holds
# .unpacked-ok and MARKER (a file of the sdist, relative to its root); else
# the tarball CACHE/PROJECT-VERSION.tar.gz (kept; discarded when its sha256
# is not SHA256) is fetched from pip's index (download_from_index), checked
# against SHA256 and unpacked. Where the index route fails, FALLBACK DEST
# (a function) is called: it leaves the tarball at DEST, or unpacks the
# tree itself (with .unpacked-ok). Dies when none of this works.
fetch_sdist() {
  local project=$1 version=$2 sha=$3 cache=$4 marker=$5 fallback=${6:-}
  local base="$project-$version"
  local root="$cache/$base" tarball="$cache/$base.tar.gz"
  if [[ -f "$root/.unpacked-ok" && -f "$root/$marker" ]]; then
    log "sdist tree $root is ready"
    return 0
  fi
  mkdir -p "$cache"
  if [[ -f "$tarball" && "$(sha256_of "$tarball")" != "$sha" ]]; then
    log "discarding $tarball (sha256 mismatch)"
    rm -f "$tarball"
  fi
  if [[ ! -f "$tarball" ]] && ! download_from_index "$project" "$base.tar.gz" "$tarball"; then
    if [[ -z "$fallback" ]] || ! "$fallback" "$tarball"; then
      die "could not fetch $base.tar.gz"
    fi
    if [[ -f "$root/.unpacked-ok" && -f "$root/$marker" ]]; then
      return 0
    fi
  fi
  [[ "$(sha256_of "$tarball")" == "$sha" ]] || { rm -f "$tarball"; die "$base.tar.gz: sha256 mismatch"; }
  local stage; stage="$(mktemp -d "$cache/.unpack.XXXXXX")"
  tar -xzf "$tarball" -C "$stage" --no-same-owner
  [[ -f "$stage/$base/$marker" ]] || die "unexpected sdist layout in $tarball"
  rm -rf "$root"
  mv "$stage/$base" "$root"
  rmdir "$stage"
  touch "$root/.unpacked-ok"
  log "unpacked sdist to $root"
}

# ---------------------------------------------------------------------------
# test passes
# ---------------------------------------------------------------------------
# runner_pass NAME CWD [ENV ...] -- [RUNNER_OPTION ...] -- [PYTEST_ARG ...]:
# one pytest pass through scripts/vllm_parity_pass.py (a hung test costs that
# test, not the pass), run in CWD by VENV_PY under `env ENV...` (VAR=value
# settings, `-u VAR` first), within PASS_TIMEOUT plus twice STALL_TIMEOUT
# plus 2 minutes. The runner writes NAME.log, NAME.outcomes and
# NAME.unexpected under RESULTS_DIR. Sets PASS_RC[NAME] to 0 when the pass
# completed (its tests' outcomes are the caller's to judge) and returns 0;
# else logs the log's tail, sets PASS_RC[NAME]=1 and returns 1. Reads
# VENV_PY, RESULTS_DIR, PASS_TIMEOUT, STALL_TIMEOUT.
declare -A PASS_RC=()
# shellcheck disable=SC2034  # PASS_RC: the calling script's verdicts, pass by pass
runner_pass() {
  local name=$1 cwd=$2; shift 2
  local envs=() opts=() rc=0
  while [[ $# -gt 0 && $1 != -- ]]; do envs+=("$1"); shift; done
  [[ $# -eq 0 ]] || shift
  while [[ $# -gt 0 && $1 != -- ]]; do opts+=("$1"); shift; done
  [[ $# -eq 0 ]] || shift
  env "${envs[@]}" timeout "$(( PASS_TIMEOUT + 2 * STALL_TIMEOUT + 120 ))" \
    "$VENV_PY" "$REPO_ROOT/scripts/vllm_parity_pass.py" --name "$name" --results "$RESULTS_DIR" \
      --cwd "$cwd" --python "$VENV_PY" --budget "$PASS_TIMEOUT" --stall "$STALL_TIMEOUT" "${opts[@]}" -- "$@" \
    || rc=$?
  if [[ $rc -ne 0 ]]; then
    log "pass $name did not complete (exit status $rc), see $RESULTS_DIR/$name.log"
    tail -n 30 "$RESULTS_DIR/$name.log" >&2 || true
    PASS_RC[$name]=1
    return 1
  fi
  PASS_RC[$name]=0
}

# passes_verdict [PREFIX]: logs "FAILED: PREFIXNAME" for each pass whose
# PASS_RC is not 0; returns 1 if there is one, else 0.
passes_verdict() {
  local rc=0 n
  for n in "${!PASS_RC[@]}"; do
    [[ ${PASS_RC[$n]} == 0 ]] || { log "FAILED: ${1:-}$n"; rc=1; }
  done
  return "$rc"
}

# passed_not_in A B: the tests that passed in the outcome list A and not in
# B (lists of "nodeid<TAB>outcome" lines, as runner_pass writes them), one
# "nodeid<TAB>its outcome in B" line each ("missing" where B lacks it), in
# A's order.
passed_not_in() {
  awk -F'\t' 'NR == FNR { b[$1] = $2; next }
              $2 == "passed" && !($1 in b) { print $1 "\tmissing"; next }
              $2 == "passed" && b[$1] != "passed" { print $1 "\t" b[$1] }' "$2" "$1"
}
