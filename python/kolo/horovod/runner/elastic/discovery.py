"""Host discovery by horovodrun's names: what finds an elastic job's hosts
and their slots. kolo's driver runs a discovery script itself
(`kolo run --host-discovery-script`); these classes are for code that
subclasses or calls them."""

import subprocess


class HostDiscovery:
    """Finds the hosts available now: `{hostname: slots}`."""

    def find_available_hosts_and_slots(self):
        raise NotImplementedError("a HostDiscovery must implement find_available_hosts_and_slots()")


class HostDiscoveryScript(HostDiscovery):
    """The hosts a script prints, `host` or `host:slots` a line (a host
    without slots gets `slots`)."""

    def __init__(self, discovery_script, slots):
        self._script, self._default_slots = discovery_script, slots

    def find_available_hosts_and_slots(self):
        printed = subprocess.run([self._script], check=True, capture_output=True, text=True).stdout
        hosts = {}
        for line in printed.splitlines():
            line = line.strip()
            if not line:
                continue
            host, _, slots = line.partition(":")
            if not slots and self._default_slots is None:
                raise ValueError(
                    f"the discovery script printed {line!r} without slots, and no --slots-per-host was given"
                )
            hosts[host] = int(slots) if slots else self._default_slots
        return hosts


class FixedHosts(HostDiscovery):
    """Always the same hosts."""

    def __init__(self, available_hosts):
        self._hosts = dict(available_hosts)

    def find_available_hosts_and_slots(self):
        return dict(self._hosts)

    def set(self, available_hosts):
        self._hosts = dict(available_hosts)
