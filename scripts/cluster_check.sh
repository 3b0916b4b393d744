#!/usr/bin/env bash
# The whole cbserve path on a real cluster, one command: build the CPU server image and the operator
# image, install the chart, apply examples/cbdeployment-cpu.yaml (the embedded SmolLM2 on the CPU),
# wait until it is Ready, send a chat through a port-forward, scale it, roll out a config change,
# undo it, let `helm test` ask it, delete it, uninstall the chart. Every step is reported as PASS,
# FAIL or SKIP (why) in a table at the end.
#
#   scripts/cluster_check.sh                       # the current kubeconfig context; images built here
#   scripts/cluster_check.sh --kind                # a throwaway kind cluster (needs kind and docker)
#   scripts/cluster_check.sh --image-registry registry.example.com/ml   # push the images there
#   scripts/cluster_check.sh --skip-build          # the images exist already (loaded or pushed)
#   scripts/cluster_check.sh --out reports/cluster # also write the table to reports/cluster/cluster_check.txt
#
# Exit codes: 0 every step passed, 1 a step failed, 2 bad usage, 3 a prerequisite is missing (no
# docker engine, kubectl, helm, curl, python3, or no reachable API server): nothing was touched.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CHART="$ROOT/charts/cbserve"
EXAMPLE="$ROOT/examples/cbdeployment-cpu.yaml"
NAME=smollm2-cpu                      # metadata.name in the example
NAMESPACE=cbserve-check               # where the CBDeployment runs
OPERATOR_NAMESPACE=cbserve-check-system
RELEASE=cbserve                       # the operator's Deployment is <release>-operator
KIND_CLUSTER=cbserve-check
PORT=18000                            # the local end of the port-forward
TIMEOUT=900                           # seconds for each wait (image pulls, model load on a slow node)

use_kind=0
registry=""
skip_build=0
out_dir=""
keep=0

usage() {
    sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    echo "Options: --kind, --image-registry REG, --skip-build, --out DIR, --timeout SECONDS, --keep (no cleanup)"
}

while [ $# -gt 0 ]; do
    case "$1" in
        --kind) use_kind=1 ;;
        --image-registry) registry=${2:?--image-registry needs a value}; shift ;;
        --skip-build) skip_build=1 ;;
        --out) out_dir=${2:?--out needs a directory}; shift ;;
        --timeout) TIMEOUT=${2:?--timeout needs seconds}; shift ;;
        --keep) keep=1 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

TAG=$(awk -F'"' '/^appVersion:/ {print $2}' "$CHART/Chart.yaml")
repo_prefix=${registry:-localhost}
SERVER_REPO="$repo_prefix/cbserve-cpu"
OPERATOR_REPO="$repo_prefix/cbserve-operator"
SERVER_IMAGE="$SERVER_REPO:$TAG"
OPERATOR_IMAGE="$OPERATOR_REPO:$TAG"

STEPS=(prerequisites cluster build-images load-images helm-install apply-example wait-ready chat scale
       config-rollout rollout-undo helm-test delete helm-uninstall)
declare -A RESULT=()
failed=""

report() {
    local table step
    table=$(
        printf '%-16s %s\n' STEP RESULT
        for step in "${STEPS[@]}"; do
            printf '%-16s %s\n' "$step" "${RESULT[$step]:-SKIP (not reached)}"
        done
    )
    echo
    echo "cluster_check: $SERVER_IMAGE, $OPERATOR_IMAGE"
    echo "$table"
    if [ -n "$out_dir" ]; then
        mkdir -p "$out_dir"
        printf '%s\n' "$table" > "$out_dir/cluster_check.txt"
        echo "written to $out_dir/cluster_check.txt"
    fi
}

# run_step NAME FUNCTION: runs FUNCTION in a subshell with errexit on (outside an `if`, where bash
# would switch errexit off) and records PASS or FAIL; after a failure the later steps are skipped.
run_step() {
    local name=$1 fn=$2 rc
    if [ -n "$failed" ]; then
        RESULT[$name]="SKIP (after $failed failed)"
        return 0
    fi
    echo "== $name"
    set +e
    (set -e; "$fn")
    rc=$?
    set -e
    if [ $rc -eq 0 ]; then
        RESULT[$name]=PASS
    elif [ $rc -eq 99 ]; then
        RESULT[$name]="SKIP ($(cat "$WORK/skip-reason"))"
    else
        RESULT[$name]="FAIL (exit $rc)"
        failed=$name
    fi
}

skip() {  # inside a step: record why it did nothing
    echo "$1" > "$WORK/skip-reason"
    echo "skipped: $1"
    exit 99
}

WORK=$(mktemp -d)
created_kind=0
installed=0
applied=0

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [ "$keep" -eq 0 ]; then
        if [ "$applied" -eq 1 ]; then
            kubectl delete namespace "$NAMESPACE" --ignore-not-found --wait=true --timeout=120s >/dev/null 2>&1 || true
        fi
        if [ "$installed" -eq 1 ]; then
            helm uninstall "$RELEASE" -n "$OPERATOR_NAMESPACE" --wait --timeout 120s >/dev/null 2>&1 || true
            kubectl delete namespace "$OPERATOR_NAMESPACE" --ignore-not-found --wait=false >/dev/null 2>&1 || true
        fi
        if [ "$created_kind" -eq 1 ]; then
            kind delete cluster --name "$KIND_CLUSTER" >/dev/null 2>&1 || true
        fi
    elif [ "$created_kind" -eq 1 ] || [ "$installed" -eq 1 ]; then
        echo "--keep: left the cluster as it is (kind cluster $KIND_CLUSTER: $created_kind, release $RELEASE in $OPERATOR_NAMESPACE)"
    fi
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------------------------------------
# Prerequisites: checked before anything touches a cluster or builds an image.
missing=()
need_docker=$(( use_kind == 1 || skip_build == 0 ))
if [ "$need_docker" -eq 1 ]; then
    if ! command -v docker >/dev/null 2>&1; then
        missing+=("docker: not on PATH (needed to build the images, and by kind)")
    elif ! timeout 20 docker info >/dev/null 2>&1; then
        missing+=("docker: the command is here but no Docker engine answers (docker info failed)")
    fi
fi
if [ "$use_kind" -eq 1 ] && ! command -v kind >/dev/null 2>&1; then
    missing+=("kind: not on PATH (--kind creates the cluster with it)")
fi
for tool in kubectl helm curl python3; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool: not on PATH")
done
if [ "$use_kind" -eq 0 ] && command -v kubectl >/dev/null 2>&1; then
    if ! server=$(timeout 30 kubectl version --request-timeout=10s -o json 2>"$WORK/kubectl-version.err"); then
        missing+=("a Kubernetes API server: kubectl version could not reach one ($(tail -n 1 "$WORK/kubectl-version.err"))")
    else
        echo "API server: $(printf '%s' "$server" | python3 -c 'import json, sys; print(json.load(sys.stdin)["serverVersion"]["gitVersion"])' 2>/dev/null || echo reachable)"
    fi
fi

if [ ${#missing[@]} -gt 0 ]; then
    echo "cluster_check: cannot run here; nothing was built, installed or changed. Missing:"
    for m in "${missing[@]}"; do
        echo "  - $m"
    done
    echo "Not done here: build the images, load or push them, helm install, apply the CPU example, wait"
    echo "for Ready, chat through a port-forward, scale, roll out a config change, undo it, helm test,"
    echo "delete, helm uninstall. Run it where Docker and a cluster exist (--kind for a throwaway one)."
    names=$(printf '%s\n' "${missing[@]}" | sed 's/:.*//' | paste -sd, - | sed 's/,/, /g')
    RESULT[prerequisites]="FAIL (missing: $names)"
    for step in "${STEPS[@]:1}"; do
        RESULT[$step]="SKIP (prerequisites missing)"
    done
    report
    exit 3
fi
RESULT[prerequisites]=PASS

# ---------------------------------------------------------------------------------------------
# The steps.
step_cluster() {
    if [ "$use_kind" -eq 0 ]; then
        skip "the current context, $(kubectl config current-context)"
    fi
    echo 1 > "$WORK/created-kind"  # cleanup deletes it, even when the create fails half-way
    kind create cluster --name "$KIND_CLUSTER" --wait 300s
    kubectl version --request-timeout=10s >/dev/null
}

step_build_images() {
    if [ "$skip_build" -eq 1 ]; then
        skip "--skip-build"
    fi
    docker build --target cpu -t "$SERVER_IMAGE" "$ROOT"
    docker build --target operator -t "$OPERATOR_IMAGE" "$ROOT"
}

step_load_images() {
    if [ -n "$registry" ]; then
        docker push "$SERVER_IMAGE"
        docker push "$OPERATOR_IMAGE"
    elif [ "$use_kind" -eq 1 ]; then
        kind load docker-image "$SERVER_IMAGE" "$OPERATOR_IMAGE" --name "$KIND_CLUSTER"
    else
        skip "no --image-registry and no --kind: the nodes must already have $SERVER_IMAGE and $OPERATOR_IMAGE"
    fi
}

step_helm_install() {
    echo 1 > "$WORK/installed"
    helm install "$RELEASE" "$CHART" --namespace "$OPERATOR_NAMESPACE" --create-namespace \
        --set image.repository="$OPERATOR_REPO" --set image.tag="$TAG" \
        --set serverImage.repository="$SERVER_REPO" --set serverImage.tag="$TAG" \
        --set test.cbdeployment="$NAME" --set test.namespace="$NAMESPACE" \
        --wait --timeout "${TIMEOUT}s"
    kubectl -n "$OPERATOR_NAMESPACE" rollout status "deployment/$RELEASE-operator" --timeout="${TIMEOUT}s"
}

step_apply_example() {
    echo 1 > "$WORK/applied"
    kubectl create namespace "$NAMESPACE" --dry-run=client -o yaml | kubectl apply -f -
    sed "s|^\(  image:\) .*|\1 $SERVER_IMAGE|" "$EXAMPLE" | kubectl -n "$NAMESPACE" apply -f -
    kubectl -n "$NAMESPACE" get cbd "$NAME"
}

step_wait_ready() {
    kubectl -n "$NAMESPACE" wait "cbd/$NAME" --for=condition=Ready --timeout="${TIMEOUT}s" \
        || { kubectl -n "$NAMESPACE" describe "cbd/$NAME"; kubectl -n "$NAMESPACE" get pods -o wide; exit 1; }
    kubectl -n "$NAMESPACE" get cbd "$NAME" -o wide
}

step_chat() {
    kubectl -n "$NAMESPACE" port-forward "svc/$NAME" "$PORT:8000" >"$WORK/port-forward.log" 2>&1 &
    local forward=$!
    trap 'kill "$forward" 2>/dev/null || true' EXIT
    curl -sS --fail --retry 30 --retry-connrefused --retry-delay 1 --max-time 300 \
        "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
        -d "{\"model\": \"$NAME\", \"max_tokens\": 16, \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}]}" \
        > "$WORK/chat.json"
    python3 - "$WORK/chat.json" <<'PY'
import json, sys
answer = json.load(open(sys.argv[1]))
text = answer["choices"][0]["message"]["content"]
print(json.dumps({"object": answer.get("object"), "model": answer.get("model"), "answer": text}))
sys.exit(0 if answer.get("object") == "chat.completion" and text.strip() else 1)
PY
}

config_hash() {
    kubectl -n "$NAMESPACE" get "deployment/$NAME" -o jsonpath='{.spec.template.metadata.annotations.cbserve\.io/config-hash}'
}

# wait_for SECONDS WHAT COMMAND...: polls COMMAND every 2 s until it succeeds, at most SECONDS.
wait_for() {
    local limit=$1 what=$2 waited=0
    shift 2
    until "$@"; do
        if [ "$waited" -ge "$limit" ]; then
            echo "timed out after ${limit}s waiting for $what" >&2
            return 1
        fi
        sleep 2
        waited=$((waited + 2))
    done
}

step_scale() {
    kubectl -n "$NAMESPACE" scale "cbd/$NAME" --replicas=2
    kubectl -n "$NAMESPACE" wait "cbd/$NAME" --for=jsonpath='{.status.readyReplicas}'=2 --timeout="${TIMEOUT}s"
    kubectl -n "$NAMESPACE" rollout status "deployment/$NAME" --timeout="${TIMEOUT}s"
    [ "$(kubectl -n "$NAMESPACE" get "deployment/$NAME" -o jsonpath='{.spec.replicas}')" = 2 ]
}

hash_differs() { [ "$(config_hash)" != "$1" ]; }

step_config_rollout() {
    local before
    before=$(config_hash)
    echo "$before" > "$WORK/hash-before"
    kubectl -n "$NAMESPACE" patch "cbd/$NAME" --type merge -p '{"spec": {"engine": {"maxQueueSize": 128}}}'
    wait_for 120 "the operator to render the new config" hash_differs "$before"
    kubectl -n "$NAMESPACE" rollout status "deployment/$NAME" --timeout="${TIMEOUT}s"
    echo "config hash $before -> $(config_hash)"
}

hash_is() { [ "$(config_hash)" = "$1" ]; }

step_rollout_undo() {
    local before
    before=$(cat "$WORK/hash-before")
    kubectl -n "$NAMESPACE" rollout undo "deployment/$NAME"
    kubectl -n "$NAMESPACE" rollout status "deployment/$NAME" --timeout="${TIMEOUT}s"
    kubectl -n "$NAMESPACE" wait "cbd/$NAME" --for=condition=RolledBack --timeout=120s
    kubectl -n "$NAMESPACE" get "cbd/$NAME" -o jsonpath='{.status.rolledBack}' | grep -q .
    hash_is "$before"  # the operator kept the undone template: the config from before the patch
    echo "rolled back to config hash $before: $(kubectl -n "$NAMESPACE" get "cbd/$NAME" -o jsonpath='{.status.rolledBack}')"
}

step_helm_test() {
    helm test "$RELEASE" -n "$OPERATOR_NAMESPACE" --logs --timeout "${TIMEOUT}s"
}

children_gone() {
    [ -z "$(kubectl -n "$NAMESPACE" get deployments,services,configmaps,replicasets \
        -l "app.kubernetes.io/instance=$NAME" -o name)" ]
}

step_delete() {
    kubectl -n "$NAMESPACE" delete "cbd/$NAME" --wait=true --timeout=120s
    wait_for 180 "garbage collection of $NAME's children" children_gone
}

step_helm_uninstall() {
    helm uninstall "$RELEASE" -n "$OPERATOR_NAMESPACE" --wait --timeout 300s
    rm -f "$WORK/installed"
    echo "the CRD stays (Helm never deletes crds/): kubectl delete crd cbdeployments.cbserve.io"
}

# the flags cleanup reads, set by steps that ran in subshells
sync_flags() {
    [ -f "$WORK/created-kind" ] && created_kind=1
    [ -f "$WORK/installed" ] && installed=1 || installed=0
    [ -f "$WORK/applied" ] && applied=1
    return 0
}

run_step cluster step_cluster; sync_flags
run_step build-images step_build_images
run_step load-images step_load_images
run_step helm-install step_helm_install; sync_flags
run_step apply-example step_apply_example; sync_flags
run_step wait-ready step_wait_ready
run_step chat step_chat
run_step scale step_scale
run_step config-rollout step_config_rollout
run_step rollout-undo step_rollout_undo
run_step helm-test step_helm_test
run_step delete step_delete
run_step helm-uninstall step_helm_uninstall; sync_flags

report
[ -z "$failed" ] || exit 1
