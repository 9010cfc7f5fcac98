"""A local host for the dbfanout Functions app (``dbfanout run``): no Functions host needed."""

from dbfanout.host.app_loader import DEFAULT_APP, FunctionSpec, discover, load_app
from dbfanout.host.host import LocalHost
from dbfanout.host.hostjson import HostJson, ServiceBusOptions, load_host_json
from dbfanout.host.schedule import Schedule, parse_schedule

__all__ = [
    "DEFAULT_APP",
    "FunctionSpec",
    "HostJson",
    "LocalHost",
    "Schedule",
    "ServiceBusOptions",
    "discover",
    "load_app",
    "load_host_json",
    "parse_schedule",
]
