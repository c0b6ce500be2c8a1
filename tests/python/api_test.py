"""The gRPC API as a client in another language sees it.

Generates a Python client from proto/ with grpcio-tools, starts
`lockstep serve` on a fresh state directory, discovers the service by server
reflection, checks grpc.health.v1 (the API and a replica), and then sends
every error case of the table in proto/lockstep/environment/v1/environment.proto,
checking the documented status code of each.

`lockstep serve` runs as it does by default: every API call carries the
token it made in its state directory (STATE/api.token) as
`authorization: Bearer TOKEN` (health and reflection need none, but a
replica's health, `replica/NAME`, does), and the
metrics endpoint asks the read-only token it made there (STATE/metrics.token).

Run by `cargo xtask test` (which skips it, saying why, if Python or the grpc
packages are missing): python3 tests/python/api_test.py --lockstep BIN
Ends with the line 'N passed, N failed'; exits 1 if anything failed.
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time

import grpc
from grpc_tools import protoc


def generate(out):
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "proto")
    files = [
        "lockstep/compute/v1/compute.proto",
        "lockstep/environment/v1/environment.proto",
        "lockstep/plan/v1/plan.proto",
    ]
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    for f in files:
        rc = protoc.main(
            ["protoc", f"-I{root}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}", f]
        )
        if rc != 0:
            raise SystemExit(f"protoc failed on {f}")
    sys.path.insert(0, out)


class Results:
    def __init__(self):
        self.passed = 0
        self.failed = []

    def check(self, name, ok, detail=""):
        if ok:
            self.passed += 1
            print(f"api: ok   {name}")
        else:
            self.failed.append(name)
            print(f"api: FAIL {name} {detail}")

    def code(self, name, call, expected):
        try:
            result = call()
            if hasattr(result, "__next__"):
                for _ in result:
                    pass
            self.check(name, False, f"expected {expected.name}, the call succeeded")
        except grpc.RpcError as e:
            self.check(name, e.code() == expected, f"expected {expected.name}, got {e.code().name}: {e.details()}")


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
    grpc.ClientCallDetails,
):
    pass


class Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer TOKEN` to the metadata of every call."""

    def __init__(self, token):
        self.header = ("authorization", "Bearer " + token)

    def _details(self, d):
        return _CallDetails(
            d.method,
            d.timeout,
            list(d.metadata or []) + [self.header],
            d.credentials,
            getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None),
        )

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)


def read_token(state, name):
    """The first line of STATE/NAME, which `lockstep serve` wrote before its serving line."""
    with open(os.path.join(state, name)) as f:
        return f.readline().strip()


def start(lockstep, state, extra):
    proc = subprocess.Popen(
        [lockstep, "serve", "--listen", "127.0.0.1:0", "--state-dir", state, "--orphan-interval-secs", "0"] + extra,
        stdout=subprocess.PIPE,
        env={**os.environ, "LOCKSTEP_LOG": os.environ.get("LOCKSTEP_LOG", "warn")},
    )
    line = proc.stdout.readline().decode()
    m = re.match(r"lockstep: serving on (\S+)", line)
    if not m:
        proc.kill()
        raise SystemExit(f"unexpected first line from lockstep serve: {line!r}")
    metrics = re.search(r"metrics on (\S+)", line)
    return proc, m.group(1), metrics and metrics.group(1)


def metric_families(url, token=None):
    """GETs url (with `token` as its bearer, if any) and parses it with
    prometheus_client's OpenMetrics parser, which raises on anything that is
    not valid OpenMetrics."""
    import urllib.request
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", "Bearer " + token)
    with urllib.request.urlopen(request, timeout=10) as answer:
        content_type = answer.headers.get("Content-Type", "")
        text = answer.read().decode()
    return content_type, {f.name: f for f in text_string_to_metric_families(text)}


def sample(families, family, name, **labels):
    """The value of the sample `name` of `family` with (at least) `labels`, or None."""
    f = families.get(family)
    for s in f.samples if f else []:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lockstep", required=True)
    args = ap.parse_args()
    gen = tempfile.mkdtemp(prefix="lockstep-py-")
    generate(gen)
    from lockstep.compute.v1 import compute_pb2 as cp
    from lockstep.plan.v1 import plan_pb2 as pp
    from lockstep.environment.v1 import environment_pb2 as ep
    from lockstep.environment.v1 import environment_pb2_grpc as eg
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    r = Results()
    # mkdtemp makes it 0700, as `lockstep serve` requires.
    state = tempfile.mkdtemp(prefix="lockstep-py-state-")
    proc, addr, metrics_url = start(
        args.lockstep, state, ["--compaction-lag", "4", "--metrics-listen", "127.0.0.1:0"]
    )
    try:
        token = read_token(state, "api.token")
        metrics_token = read_token(state, "metrics.token")
        channel = grpc.insecure_channel(addr)
        grpc.channel_ready_future(channel).result(timeout=30)
        # Health and reflection on the bare channel (they need no token, but
        # a replica's health does), the API with its token on every call.
        authorized = grpc.intercept_channel(channel, Bearer(token))
        api = eg.EnvironmentStub(authorized)

        # The token: a call without it, or with the metrics token, is refused.
        r.code(
            "an API call without the token: UNAUTHENTICATED",
            lambda: eg.EnvironmentStub(channel).GetStatus(ep.GetStatusRequest()),
            grpc.StatusCode.UNAUTHENTICATED,
        )
        r.code(
            "an API call with the metrics token: UNAUTHENTICATED",
            lambda: eg.EnvironmentStub(channel).GetStatus(
                ep.GetStatusRequest(), metadata=(("authorization", "Bearer " + metrics_token),)
            ),
            grpc.StatusCode.UNAUTHENTICATED,
        )

        # Discovery by reflection.
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        services = {s.name for s in answers[0].list_services_response.service}
        r.check("reflection lists the API", "lockstep.environment.v1.Environment" in services, str(services))
        r.check("reflection lists health", "grpc.health.v1.Health" in services, str(services))
        answers = list(
            refl.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol="lockstep.environment.v1.Environment")])
            )
        )
        r.check(
            "reflection describes the API",
            answers[0].HasField("file_descriptor_response")
            and len(answers[0].file_descriptor_response.file_descriptor_proto) >= 1,
            str(answers[0]),
        )

        # Health.
        health = health_pb2_grpc.HealthStub(channel)
        S = health_pb2.HealthCheckResponse.SERVING
        r.check("health of the server", health.Check(health_pb2.HealthCheckRequest(service="")).status == S)
        r.check(
            "health of the API",
            health.Check(health_pb2.HealthCheckRequest(service="lockstep.environment.v1.Environment")).status == S,
        )
        r.code(
            "health of an unknown replica: NOT_FOUND",
            lambda: health.Check(health_pb2.HealthCheckRequest(service="replica/nope")),
            grpc.StatusCode.NOT_FOUND,
        )

        api.CreateReplica(ep.CreateReplicaRequest(name="py", processes=2, workers_per_process=1))
        deadline = time.time() + 30
        status = None
        token_health = health_pb2_grpc.HealthStub(authorized)
        while time.time() < deadline:
            try:
                status = token_health.Check(health_pb2.HealthCheckRequest(service="replica/py")).status
                if status == S:
                    break
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        r.check("health of a running replica, with the token: SERVING", status == S, str(status))
        r.code(
            "health of a running replica without the token: NOT_FOUND (as an unknown one)",
            lambda: health.Check(health_pb2.HealthCheckRequest(service="replica/py")),
            grpc.StatusCode.NOT_FOUND,
        )

        # An export's description is the family's bytes: for the built-in
        # family, an encoded lockstep.plan.v1.Plan.
        def export(cid, plan):
            return cp.Export(collection_id=cid, description=plan.SerializeToString())

        def get(c):
            return pp.Plan(get=pp.Get(collection_id=c))

        def create(name, inputs, exports, replica="py"):
            return api.CreateDataflow(ep.CreateDataflowRequest(replica=replica, name=name, inputs=inputs, exports=exports))

        def write(collection, updates, upper, replica="py"):
            return api.WriteInput(
                ep.WriteInputRequest(replica=replica, collection_id=collection, updates=updates, upper=upper)
            )

        # A row is its family's bytes: for the built-in family, 64-bit
        # integers as canonical varints (a packed int64's bytes).
        def encode_row(values):
            out = bytearray()
            for v in values:
                v &= (1 << 64) - 1
                while v >= 0x80:
                    out.append((v & 0x7F) | 0x80)
                    v >>= 7
                out.append(v)
            return bytes(out)

        def up(row, time_, diff):
            return cp.Update(row=encode_row(row), time=time_, diff=diff)

        d = create("ok", [1], [export(101, get(1))]).dataflow
        for t in range(12):
            write(1, [up([t], t, 1)], t + 1)

        C = grpc.StatusCode
        # CreateReplica
        r.code("CreateReplica, empty name: INVALID_ARGUMENT", lambda: api.CreateReplica(ep.CreateReplicaRequest(name="", processes=1, workers_per_process=1)), C.INVALID_ARGUMENT)
        r.code("CreateReplica, zero processes: INVALID_ARGUMENT", lambda: api.CreateReplica(ep.CreateReplicaRequest(name="z", processes=0, workers_per_process=1)), C.INVALID_ARGUMENT)
        r.code("CreateReplica, name taken: ALREADY_EXISTS", lambda: api.CreateReplica(ep.CreateReplicaRequest(name="py", processes=1, workers_per_process=1)), C.ALREADY_EXISTS)
        # DropReplica
        r.code("DropReplica, empty name: INVALID_ARGUMENT", lambda: api.DropReplica(ep.DropReplicaRequest(name="")), C.INVALID_ARGUMENT)
        r.code("DropReplica, unknown: NOT_FOUND", lambda: api.DropReplica(ep.DropReplicaRequest(name="nope")), C.NOT_FOUND)
        # RestartReplica
        r.code("RestartReplica, empty name: INVALID_ARGUMENT", lambda: api.RestartReplica(ep.RestartReplicaRequest(name="")), C.INVALID_ARGUMENT)
        r.code("RestartReplica, unknown: NOT_FOUND", lambda: api.RestartReplica(ep.RestartReplicaRequest(name="nope")), C.NOT_FOUND)
        # CreateDataflow
        r.code("CreateDataflow, unknown replica: NOT_FOUND", lambda: create("x", [1], [export(900, get(1))], replica="nope"), C.NOT_FOUND)
        r.code("CreateDataflow, empty replica name: INVALID_ARGUMENT", lambda: create("x", [1], [export(900, get(1))], replica=""), C.INVALID_ARGUMENT)
        r.code("CreateDataflow, no export: INVALID_ARGUMENT", lambda: create("x", [1], []), C.INVALID_ARGUMENT)
        r.code("CreateDataflow, a format the replicas do not build: INVALID_ARGUMENT", lambda: api.CreateDataflow(ep.CreateDataflowRequest(replica="py", name="x", inputs=[1], exports=[export(900, get(1))], format="another.family.v1")), C.INVALID_ARGUMENT)
        r.code("CreateDataflow, undeclared input: INVALID_ARGUMENT", lambda: create("x", [1], [export(900, get(7))]), C.INVALID_ARGUMENT)
        r.code("CreateDataflow, an export twice: INVALID_ARGUMENT", lambda: create("x", [1], [export(900, get(1)), export(900, get(1))]), C.INVALID_ARGUMENT)
        r.code("CreateDataflow, export ID in use: ALREADY_EXISTS", lambda: create("x", [1], [export(101, get(1))]), C.ALREADY_EXISTS)
        r.code("CreateDataflow, export ID is an input: ALREADY_EXISTS", lambda: create("x", [2], [export(1, get(2))]), C.ALREADY_EXISTS)
        r.code("CreateDataflow, reads an export: INVALID_ARGUMENT", lambda: create("x", [101], [export(900, get(101))]), C.INVALID_ARGUMENT)
        deep = get(1)
        for _ in range(40):
            deep = pp.Plan(filter=pp.Filter(input=deep))
        r.code("CreateDataflow, plan too deep: INVALID_ARGUMENT", lambda: create("x", [1], [export(900, deep)]), C.INVALID_ARGUMENT)
        r.code("CreateDataflow, plan missing: INVALID_ARGUMENT", lambda: create("x", [1], [cp.Export(collection_id=900)]), C.INVALID_ARGUMENT)
        r.code("CreateDataflow, description not a plan: INVALID_ARGUMENT", lambda: create("x", [1], [cp.Export(collection_id=900, description=b"\xff\xff")]), C.INVALID_ARGUMENT)
        # DropDataflow
        r.code("DropDataflow, unknown: NOT_FOUND", lambda: api.DropDataflow(ep.DropDataflowRequest(id=999999)), C.NOT_FOUND)
        # WriteInput
        r.code("WriteInput, unknown replica: NOT_FOUND", lambda: write(1, [], 20, replica="nope"), C.NOT_FOUND)
        r.code("WriteInput, to an export: INVALID_ARGUMENT", lambda: write(101, [up([1], 12, 1)], 13), C.INVALID_ARGUMENT)
        r.code("WriteInput, upper below the current: OUT_OF_RANGE", lambda: write(1, [], 3), C.OUT_OF_RANGE)
        r.code("WriteInput, time below the upper: OUT_OF_RANGE", lambda: write(1, [up([1], 2, 1)], 20), C.OUT_OF_RANGE)
        r.code("WriteInput, time not below the new upper: OUT_OF_RANGE", lambda: write(1, [up([1], 20, 1)], 20), C.OUT_OF_RANGE)
        big = 2**63 - 1
        r.code("WriteInput, a row that is not the built-in family's: INVALID_ARGUMENT", lambda: write(1, [cp.Update(row=b"\x81\x00", time=12, diff=1)], 13), C.INVALID_ARGUMENT)
        r.code("WriteInput, multiplicities overflow: INVALID_ARGUMENT", lambda: write(1, [up([5], 12, big), up([6], 12, big)], 13), C.INVALID_ARGUMENT)
        # ListReplicas, ListDataflows: pages
        create("page", [1], [export(301, get(1))])
        first = api.ListDataflows(ep.ListDataflowsRequest(page_size=1))
        second = api.ListDataflows(ep.ListDataflowsRequest(page_size=1, page_token=first.next_page_token))
        r.check(
            "ListDataflows pages in ID order",
            len(first.dataflows) == 1 and len(second.dataflows) == 1
            and first.dataflows[0].dataflow.id < second.dataflows[0].dataflow.id
            and second.next_page_token == "",
            f"{first} / {second}",
        )
        r.code("ListDataflows, a token no page returned: INVALID_ARGUMENT", lambda: api.ListDataflows(ep.ListDataflowsRequest(page_token="x")), C.INVALID_ARGUMENT)
        r.code("ListReplicas, a token no page returned: INVALID_ARGUMENT", lambda: api.ListReplicas(ep.ListReplicasRequest(page_token="x")), C.INVALID_ARGUMENT)
        # SetPolicy, ListPolicies
        r.code("SetPolicy, empty name: INVALID_ARGUMENT", lambda: api.SetPolicy(ep.SetPolicyRequest(name="", wasm=b"\0asm")), C.INVALID_ARGUMENT)
        r.code("SetPolicy, not a policy: INVALID_ARGUMENT", lambda: api.SetPolicy(ep.SetPolicyRequest(name="junk", wasm=b"not wasm")), C.INVALID_ARGUMENT)
        # 6 MiB: within the documented 16 MiB, beyond tonic's default 4 MiB
        # decode limit; it must reach the server and be judged as a policy.
        r.code("SetPolicy, 6 MiB that is not a policy: INVALID_ARGUMENT", lambda: api.SetPolicy(ep.SetPolicyRequest(name="junk", wasm=b"x" * (6 << 20))), C.INVALID_ARGUMENT)
        r.code("SetPolicy, unknown replica: NOT_FOUND", lambda: api.SetPolicy(ep.SetPolicyRequest(name="junk", wasm=b"not wasm", replica="nope")), C.NOT_FOUND)
        kinds = sorted(p.kind for p in api.ListPolicies(ep.ListPoliciesRequest()).policies)
        r.check("ListPolicies names both kinds", kinds == ["distribution", "orphans"], str(kinds))
        # Peek
        ok = api.Peek(ep.PeekRequest(replica="py", collection_id=101, timestamp=11))
        r.check("Peek at the upper answers", len(ok.rows) == 12, str(ok))
        r.code("Peek, unknown collection: NOT_FOUND", lambda: api.Peek(ep.PeekRequest(replica="py", collection_id=555, timestamp=0)), C.NOT_FOUND)
        r.code("Peek, an input collection: NOT_FOUND", lambda: api.Peek(ep.PeekRequest(replica="py", collection_id=1, timestamp=0)), C.NOT_FOUND)
        r.code("Peek, at 2^64-1: OUT_OF_RANGE", lambda: api.Peek(ep.PeekRequest(replica="py", collection_id=101, timestamp=2**64 - 1)), C.OUT_OF_RANGE)
        r.code("Peek, below the since: OUT_OF_RANGE", lambda: api.Peek(ep.PeekRequest(replica="py", collection_id=101, timestamp=0)), C.OUT_OF_RANGE)
        # Subscribe
        r.code("Subscribe, unknown collection: NOT_FOUND", lambda: api.Subscribe(ep.SubscribeRequest(replica="py", collection_id=555, as_of=11)), C.NOT_FOUND)
        r.code("Subscribe, below the since: OUT_OF_RANGE", lambda: api.Subscribe(ep.SubscribeRequest(replica="py", collection_id=101, as_of=0)), C.OUT_OF_RANGE)
        sub = api.Subscribe(ep.SubscribeRequest(replica="py", collection_id=101, as_of=11))
        first = next(sub)
        r.check("Subscribe streams the snapshot", len(first.updates) == 12, str(first))
        api.DropDataflow(ep.DropDataflowRequest(id=d.id))
        r.code("Subscribe, dataflow dropped: NOT_FOUND", lambda: sub, C.NOT_FOUND)

        # Request IDs: the client's comes back, and one is made when none is sent.
        _, call = api.GetStatus.with_call(ep.GetStatusRequest(), metadata=(("x-request-id", "py-call-1"),))
        echoed = dict(call.initial_metadata()).get("x-request-id")
        r.check("a client's x-request-id comes back", echoed == "py-call-1", str(call.initial_metadata()))
        _, call = api.GetStatus.with_call(ep.GetStatusRequest())
        made = dict(call.initial_metadata()).get("x-request-id")
        r.check("a call without one gets an x-request-id", bool(made), str(call.initial_metadata()))

        # The format the replicas build (what the CLI reads a dataflow's and
        # a row's syntax from): the built-in family's, by default.
        status = api.GetStatus(ep.GetStatusRequest())
        r.check("GetStatus names the format served: lockstep.plan.v1", status.format == "lockstep.plan.v1", str(status))

        # Metrics: the environment's and every replica process's, each read
        # with prometheus_client's OpenMetrics parser (which raises on any
        # error in the exposition).
        r.check("serve prints its metrics address", metrics_url is not None)
        import urllib.error

        # The metrics endpoint asks its own token, on loopback too; the API
        # token is not accepted there.
        for what, bearer in (("no token", None), ("the API token", token)):
            try:
                metric_families(metrics_url, bearer)
                r.check(f"environment metrics with {what}: 401", False, "answered 200")
            except urllib.error.HTTPError as e:
                r.check(f"environment metrics with {what}: 401", e.code == 401, str(e))
        content_type, env = metric_families(metrics_url, metrics_token)
        r.check("environment metrics are OpenMetrics", content_type.startswith("application/openmetrics-text"), content_type)
        r.check(
            "environment metrics count NOT_FOUND answers of DropReplica",
            (sample(env, "lockstep_environment_api_requests", "lockstep_environment_api_requests_total", method="DropReplica", code="NOT_FOUND") or 0) >= 1,
            str(env.get("lockstep_environment_api_requests")),
        )
        r.check("environment metrics name the build", sample(env, "lockstep_environment_build_info", "lockstep_environment_build_info") == 1, str(env.get("lockstep_environment_build_info")))
        r.check(
            "environment metrics carry the standard process series",
            (sample(env, "process_cpu_seconds", "process_cpu_seconds_total") or 0) > 0
            and (sample(env, "process_resident_memory_bytes", "process_resident_memory_bytes") or 0) > 0,
            str(env.get("process_cpu_seconds")),
        )
        processes = [p for rep in api.ListReplicas(ep.ListReplicasRequest()).replicas if rep.name == "py" for p in rep.process_status]
        r.check("ListReplicas reports each process's metrics URL", len(processes) == 2 and all(p.metrics_url.startswith("http://") for p in processes), str(processes))
        for p in processes:
            content_type, rep = metric_families(p.metrics_url)
            name = f"replica process {p.index} metrics"
            r.check(f"{name} are OpenMetrics", content_type.startswith("application/openmetrics-text"), content_type)
            created = sample(rep, "lockstep_replica_commands_applied", "lockstep_replica_commands_applied_total", kind="create-dataflow")
            r.check(f"{name} count the dataflows created", (created or 0) >= 2, str(rep.get("lockstep_replica_commands_applied")))
            written = sample(rep, "lockstep_replica_commands_applied", "lockstep_replica_commands_applied_total", kind="write-input")
            r.check(f"{name} count the writes", (written or 0) >= 12, str(written))
            r.check(f"{name} know the mesh peer", sample(rep, "lockstep_replica_mesh_peers", "lockstep_replica_mesh_peers") == 1)
            # The drop reaches the workers after DropDataflow answered: read
            # again until it shows, within a bound.
            deadline = time.time() + 10
            installed = None
            while time.time() < deadline:
                installed = sample(metric_families(p.metrics_url)[1], "lockstep_replica_dataflows_installed", "lockstep_replica_dataflows_installed")
                if installed == 1:
                    break
                time.sleep(0.1)
            r.check(f"{name} count one installed dataflow after the drop", installed == 1, str(installed))
            r.check(
                f"{name} count controller bytes both ways",
                (sample(rep, "lockstep_replica_controller_bytes", "lockstep_replica_controller_bytes_total", direction="in") or 0) > 0
                and (sample(rep, "lockstep_replica_controller_bytes", "lockstep_replica_controller_bytes_total", direction="out") or 0) > 0,
            )
            r.check(f"{name} name the build", sample(rep, "lockstep_replica_build_info", "lockstep_replica_build_info") == 1)
            r.check(f"{name} carry the standard process series", (sample(rep, "process_resident_memory_bytes", "process_resident_memory_bytes") or 0) > 0)
            # The same, relayed by the environment's endpoint (one address
            # and one token for every process).
            content_type, relayed = metric_families(f"{metrics_url}/replicas/py/{p.index}", metrics_token)
            r.check(
                f"{name} relayed by the environment",
                content_type.startswith("application/openmetrics-text")
                and sample(relayed, "lockstep_replica_mesh_peers", "lockstep_replica_mesh_peers") == 1,
                content_type,
            )
        try:
            metric_families(f"{metrics_url}/replicas/nope/0", metrics_token)
            r.check("relayed metrics of an unknown replica: 404", False, "answered 200")
        except urllib.error.HTTPError as e:
            r.check("relayed metrics of an unknown replica: 404", e.code == 404, str(e))
    finally:
        proc.kill()
        proc.wait()
        # The replica's processes outlive a killed environment: stop them.
        kill_replicas(state)
    print(f"{r.passed} passed, {len(r.failed)} failed")
    sys.exit(1 if r.failed else 0)


def kill_replicas(state):
    """Kills the process groups the orchestrator recorded under STATE/orchestrator/services."""
    import json

    services = os.path.join(state, "orchestrator", "services")
    if not os.path.isdir(services):
        return
    for name in os.listdir(services):
        try:
            record = json.load(open(os.path.join(services, name)))
        except (OSError, ValueError):
            continue
        for p in record.get("processes", []):
            pid = p.get("pid")
            if pid:
                try:
                    os.killpg(pid, 9)
                except OSError:
                    pass


if __name__ == "__main__":
    main()
