"""Each Ray internal pagedserve touches is still there, in the shape it is used in.

These fail on a Ray upgrade that moves or reshapes one (the behaviour each one enables is
tested where it is used: the gRPC API, drain and start-up tests).
"""

import ast
import asyncio
import inspect
import re
from pathlib import Path

import pytest
import ray
import ray._private.utils as ray_utils
from ray._private import node, services
from ray._private import worker as ray_worker
from ray._private.workers import default_worker
from ray.experimental import internal_kv
from ray.serve._private import constants as serve_constants
from ray.serve._private import grpc_util

from pagedserve.workers import ray_internals
from pagedserve.workers.ray_internals import (
    RAY_VERSION,
    SERVE_ENV_SETTINGS,
    bound_http_responses,
    current_get_node,
    replica_wrapper_class,
    room_in_http_response,
    route_sigterm_handlers,
    serve_grpc_server_options,
    setup_hook_env_var,
    version_warning,
    wrap_get_node,
    wrap_grpc_handlers,
)

PYPROJECT = Path(__file__).parents[3] / "pyproject.toml"
LOCK = Path(__file__).parents[3] / "requirements" / "lock.txt"


def test_ray_is_pinned_to_the_version_the_internals_were_written_for(monkeypatch):
    assert f'"ray[serve]=={RAY_VERSION}"' in PYPROJECT.read_text()
    assert re.search(rf"^ray==({re.escape(RAY_VERSION)}) ", LOCK.read_text(), re.MULTILINE)
    assert ray.__version__ == RAY_VERSION and version_warning() is None
    monkeypatch.setattr(ray, "__version__", "9.9.9")
    assert "Ray 9.9.9 is installed" in version_warning() and RAY_VERSION in version_warning()


def test_worker_processes_run_the_setup_hook_named_by_the_variable():
    name = setup_hook_env_var()
    assert isinstance(name, str) and name
    assert "WORKER_PROCESS_SETUP_HOOK_ENV_VAR" in inspect.getsource(default_worker)


def test_serve_builds_its_grpc_servers_from_the_options_list_itself():
    options = serve_grpc_server_options()
    assert isinstance(options, list)
    assert grpc_util.DEFAULT_GRPC_SERVER_OPTIONS is options  # what is added applies
    assert "DEFAULT_GRPC_SERVER_OPTIONS + " in inspect.getsource(grpc_util.gRPCGenericServer)


def test_serve_s_grpc_server_takes_its_handlers_from_a_replaceable_factory():
    made = []

    def factory(service_method, streaming_type):
        made.append(service_method)
        return lambda request, context: None

    def tagging(name):
        def wrap(inner):
            def wrapped(service_method, streaming_type):
                return inner(service_method=f"{name}({service_method})", streaming_type=None)

            return wrapped

        return wrap

    async def make_server():  # a grpc.aio server needs the running loop
        return grpc_util.gRPCGenericServer(factory)

    server = asyncio.run(make_server())
    assert server.service_handler_factory is factory
    assert wrap_grpc_handlers(server, "a", tagging("a"))
    assert wrap_grpc_handlers(server, "a", tagging("a"))  # once per name
    assert wrap_grpc_handlers(server, "b", tagging("b"))
    assert wrap_grpc_handlers(server, "a", tagging("a"))  # still once, under b
    server.service_handler_factory(service_method="M", streaming_type=None)
    assert made == ["a(b(M))"]
    assert "self.service_handler_factory(" in inspect.getsource(grpc_util.gRPCGenericServer)
    assert not wrap_grpc_handlers(object(), "a", tagging("a"))


def test_proxy_calls_to_replicas_go_through_the_wrapped_method():
    wrapper = replica_wrapper_class()
    assert wrapper is not None
    parameters = inspect.signature(wrapper.send_request_python).parameters
    assert list(parameters) == ["self", "pr", "with_rejection"]
    assert parameters["with_rejection"].kind is inspect.Parameter.KEYWORD_ONLY
    # Serve's module, not the method: a test before may have wrapped it in this process.
    source = inspect.getsource(inspect.getmodule(wrapper))
    for method in ("handle_request_streaming", "handle_request_with_rejection"):
        assert f"self._actor_handle.{method}.options(" in source


def test_a_starting_node_polls_get_node(monkeypatch):
    assert "ray._private.services.get_node(" in inspect.getsource(node.Node)
    assert list(inspect.signature(services.get_node).parameters) == ["gcs_address", "node_id"]
    monkeypatch.setattr(services, "get_node", services.get_node)  # restored after the test
    original = current_get_node()
    wrap_get_node(lambda get_node: ("wrapped", get_node))
    assert current_get_node() == ("wrapped", original)


def test_ray_sets_a_worker_s_sigterm_handler_through_the_routed_helper(monkeypatch):
    assert "ray._private.utils.set_sigterm_handler(" in inspect.getsource(ray_worker)
    monkeypatch.setattr(ray_utils, "set_sigterm_handler", ray_utils.set_sigterm_handler)
    kept = []
    route_sigterm_handlers(kept.append)
    ray._private.utils.set_sigterm_handler("ray's")  # as Ray's main loop calls it
    assert kept == ["ray's"]


def test_the_gcs_key_value_store_takes_keys_values_and_namespaces_as_called():
    # The round trip runs in `tests/integration/test_worker_pool.py` (a restarted pool).
    put = inspect.signature(internal_kv._internal_kv_put).parameters
    assert list(put)[:3] == ["key", "value", "overwrite"] and "namespace" in put
    for function in (internal_kv._internal_kv_get, internal_kv._internal_kv_del):
        parameters = inspect.signature(function).parameters
        assert next(iter(parameters)) == "key" and "namespace" in parameters
    for name in ("put", "get", "del"):
        assert f"_internal_kv_{name}(" in inspect.getsource(getattr(ray_internals, f"kv_{name}"))


@pytest.mark.parametrize("name", SERVE_ENV_SETTINGS)
def test_serve_still_reads_each_environment_setting(name):
    assert f'"{name}"' in inspect.getsource(serve_constants)


def test_nothing_else_reaches_into_ray_s_internals():
    root = Path(ray_internals.__file__).parents[1]
    sources = [*(root / "cluster").rglob("*.py"), *(root / "workers").rglob("*.py")]
    assert len(sources) > 100  # every subpackage, not the top level alone
    reaching = [
        str(path.relative_to(root))
        for path in sources
        if path.name != "ray_internals.py" and _private_names(path)
    ]
    assert reaching == []


def _private_names(path: Path) -> list[str]:
    """The private Ray modules (`ray._private`, `ray.serve._private`, `ray._raylet`, the GCS
    key-value store) that `path`'s code imports or reads."""
    names = []
    for item in ast.walk(ast.parse(path.read_text())):
        if isinstance(item, ast.Import):
            names += [alias.name for alias in item.names]
        elif isinstance(item, ast.ImportFrom) and item.module:
            names.append(item.module)
        elif isinstance(item, ast.Attribute):
            names.append(ast.unparse(item))
    private = r"ray\.((serve\.)?_private|_raylet|experimental\.internal_kv)"
    return [name for name in names if re.match(private, name)]


def test_a_response_s_writer_waits_for_the_replica_to_take_its_messages(monkeypatch):
    from ray.serve._private import http_util, replica

    # Serve's replica makes the queue, then starts the ASGI app's task, which fills it.
    source = inspect.getsource(replica.UserCallableWrapper.call_http_entrypoint)
    assert source.index("result_queue = MessageQueue()") < source.index("asyncio.create_task(")
    for name in ("__init__", "get_messages_nowait"):
        monkeypatch.setattr(http_util.MessageQueue, name, getattr(http_util.MessageQueue, name))
    monkeypatch.setattr(http_util.MessageQueue, "_pagedserve_bounded", False, raising=False)
    bound_http_responses()

    async def main():
        queue = http_util.MessageQueue()
        sent = []

        async def writer():
            for i in range(5):
                await room_in_http_response(max_queued=2)
                await queue({"i": i})
                sent.append(i)

        task = asyncio.create_task(writer())  # sees the queue, as the app's task does
        while len(sent) < 2:
            await asyncio.sleep(0)
        for _ in range(10):
            await asyncio.sleep(0)
        assert sent == [0, 1]  # waits: two messages not taken
        taken = [m["i"] for m in queue.get_messages_nowait()]
        assert taken == [0, 1]
        while not task.done():  # the proxy takes what the queue holds, as it can
            await asyncio.sleep(0)
            taken += [m["i"] for m in queue.get_messages_nowait()]
        taken += [m["i"] for m in queue.get_messages_nowait()]
        assert sent == taken == [0, 1, 2, 3, 4]

    asyncio.run(main())
