//! Host lists (`-H a:4,b:2`) and host files (`a slots=4`, `b:2`), as horovodrun reads them.

use crate::TopologyError;

/// One host of a host list: its name, how many processes it may run, and
/// (for hosts that declare them) how many GPUs it offers.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct HostSpec {
    /// Host name or address, as given (IPv6 without its brackets).
    pub name: String,
    /// How many processes the host may run.
    pub slots: u32,
    /// GPUs the host declares (`gpus=N` in a host file); `None` when undeclared.
    pub gpus: Option<u32>,
}

impl HostSpec {
    /// A host with `slots` slots and no declared GPUs.
    pub fn new(name: impl Into<String>, slots: u32) -> Self {
        HostSpec { name: name.into(), slots, gpus: None }
    }

    /// What the host offers as a node of its own name: a CPU per slot and
    /// GPU ids `0..gpus`.
    pub fn resources(&self) -> crate::HostResources {
        crate::HostResources {
            hostname: self.name.clone(),
            node_id: self.name.clone(),
            cpus: self.slots,
            gpus: (0..self.gpus.unwrap_or(0)).collect(),
        }
    }
}

/// Total slots of a host list.
pub fn total_slots(hosts: &[HostSpec]) -> u64 {
    hosts.iter().map(|h| u64::from(h.slots)).sum()
}

/// Parses `-H host1:4,host2:2,host3` (a host without `:N` has one slot).
/// IPv6 addresses go in brackets: `[::1]:2`.
pub fn parse_host_list(list: &str) -> Result<Vec<HostSpec>, TopologyError> {
    if list.trim().is_empty() {
        return Err(TopologyError::BadHost {
            input: list.to_string(),
            reason: "the host list is empty; give hosts as 'host1:4,host2:2'".into(),
        });
    }
    let mut hosts = Vec::new();
    for entry in list.split(',') {
        hosts.push(parse_host_entry(entry.trim(), entry)?.0);
    }
    check_unique(&hosts)?;
    Ok(hosts)
}

/// Parses a host file: one host a line, as `host`, `host:N` or
/// `host slots=N [gpus=M]`; blank lines and `#` comments are skipped.
pub fn parse_hostfile(text: &str) -> Result<Vec<HostSpec>, TopologyError> {
    let mut hosts = Vec::new();
    for (index, raw) in text.lines().enumerate() {
        let line_no = index + 1;
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let bad =
            |reason: String| TopologyError::BadHostfileLine { line: line_no, text: raw.trim().to_string(), reason };
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or_default();
        let (mut host, mut slots_given) = parse_host_entry(first, first).map_err(|e| bad(e.reason()))?;
        for word in words {
            let (key, value) = word
                .split_once('=')
                .ok_or_else(|| bad(format!("unexpected '{word}'; write 'host slots=N' or 'host:N'")))?;
            match key {
                "slots" if slots_given => return Err(bad("slots given twice".into())),
                "slots" => {
                    host.slots = parse_count(value, "slot count", true).map_err(bad)?;
                    slots_given = true;
                }
                "gpus" => host.gpus = Some(parse_count(value, "GPU count", false).map_err(bad)?),
                _ => return Err(bad(format!("unknown key '{key}'; known keys are slots=N and gpus=N"))),
            }
        }
        hosts.push(host);
    }
    if hosts.is_empty() {
        return Err(TopologyError::BadHost { input: String::new(), reason: "the host file lists no hosts".into() });
    }
    check_unique(&hosts)?;
    Ok(hosts)
}

/// One `host[:N]` entry; the flag tells whether the slot count was written.
fn parse_host_entry(entry: &str, original: &str) -> Result<(HostSpec, bool), TopologyError> {
    let bad = |reason: &str| TopologyError::BadHost { input: original.trim().to_string(), reason: reason.to_string() };
    let (name, slots) = if let Some(rest) = entry.strip_prefix('[') {
        let (addr, tail) =
            rest.split_once(']').ok_or_else(|| bad("unclosed '[' in an IPv6 address; write '[::1]:4'"))?;
        match tail {
            "" => (addr, None),
            t => (addr, Some(t.strip_prefix(':').ok_or_else(|| bad("expected ':N' after ']'"))?)),
        }
    } else {
        match entry.split_once(':') {
            Some((name, slots)) => (name, Some(slots)),
            None => (entry, None),
        }
    };
    if name.is_empty() {
        return Err(bad("host name is empty; write 'host:N'"));
    }
    if name.chars().any(|c| c.is_whitespace() || c == '/' || c == '=') {
        return Err(bad("host name contains a character not allowed in a host name"));
    }
    let explicit = slots.is_some();
    let slots = match slots {
        None => 1,
        Some(s) => parse_count(s, "slot count", true).map_err(|r| bad(&r))?,
    };
    Ok((HostSpec::new(name, slots), explicit))
}

fn parse_count(value: &str, what: &str, positive: bool) -> Result<u32, String> {
    match value.trim().parse::<u32>() {
        Ok(0) if positive => Err(format!("{what} must be a positive integer, got '0'")),
        // refused before anything is sized by it
        Ok(n) if n > crate::MAX_PROCESSES => {
            Err(format!("{what} {n} is over kolo's limit of {} per host", crate::MAX_PROCESSES))
        }
        Ok(n) => Ok(n),
        Err(_) => Err(format!(
            "{what} must be a {} integer, got '{value}'",
            if positive { "positive" } else { "non-negative" }
        )),
    }
}

fn check_unique(hosts: &[HostSpec]) -> Result<(), TopologyError> {
    for (i, h) in hosts.iter().enumerate() {
        if hosts[..i].iter().any(|o| o.name == h.name) {
            return Err(TopologyError::DuplicateHost(h.name.clone()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_list_forms() {
        let h = parse_host_list("a:4,b:2,c").unwrap();
        assert_eq!(h, vec![HostSpec::new("a", 4), HostSpec::new("b", 2), HostSpec::new("c", 1)]);
        let h = parse_host_list(" a:4 , [::1]:2,[fe80::1]").unwrap();
        assert_eq!(h[1], HostSpec::new("::1", 2));
        assert_eq!(h[2], HostSpec::new("fe80::1", 1));
        assert_eq!(total_slots(&h), 7);
    }

    #[test]
    fn host_list_errors_name_the_input() {
        for (input, needle) in [
            ("", "empty"),
            ("a:4,,b", "host name is empty"),
            (":4", "host name is empty"),
            ("a:0", "positive integer, got '0'"),
            ("a:x", "got 'x'"),
            ("a:-1", "got '-1'"),
            ("a:", "got ''"),
            ("a:4,a:2", "'a' is listed twice"),
            ("[::1", "unclosed"),
            ("localhost:10000000", "over kolo's limit of 65536"),
        ] {
            let err = parse_host_list(input).unwrap_err().to_string();
            assert!(err.contains(needle), "{input:?}: {err}");
        }
        let err = parse_host_list("a:x").unwrap_err().to_string();
        assert!(err.contains("'a:x'"), "{err}");
    }

    #[test]
    fn hostfile_forms() {
        let text = "# cluster\n\na slots=4\nb:2   # two\n  c\nd slots=2 gpus=2\n";
        let h = parse_hostfile(text).unwrap();
        assert_eq!(h.len(), 4);
        assert_eq!(h[0], HostSpec::new("a", 4));
        assert_eq!(h[1], HostSpec::new("b", 2));
        assert_eq!(h[2], HostSpec::new("c", 1));
        assert_eq!(h[3], HostSpec { name: "d".into(), slots: 2, gpus: Some(2) });
    }

    #[test]
    fn hostfile_errors_name_the_line() {
        for (text, needle) in [
            ("a slots=x\n", "line 1"),
            ("a\nb slots=0\n", "line 2"),
            ("a slots=2 color=red\n", "unknown key 'color'"),
            ("a fast\n", "unexpected 'fast'"),
            ("a slots=1\na:2\n", "'a' is listed twice"),
            ("# nothing\n\n", "lists no hosts"),
            ("a slots=2 gpus=z\n", "GPU count"),
        ] {
            let err = parse_hostfile(text).unwrap_err().to_string();
            assert!(err.contains(needle), "{text:?}: {err}");
        }
    }
}
