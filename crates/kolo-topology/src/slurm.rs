//! Slurm's compact notations: node lists (`h[1-3,5],gpu01`) and tasks per
//! node (`2(x3),1`).

use crate::TopologyError;

fn bad(input: &str, reason: &str) -> TopologyError {
    TopologyError::BadHost { input: input.to_string(), reason: reason.to_string() }
}

/// Splits at commas outside brackets.
fn top_level_parts(list: &str) -> Vec<&str> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&list[start..]);
    parts
}

/// `h[1-3,05],gpu01` → `h1 h2 h3 h05 gpu01` (zero padding kept).
pub fn expand_nodelist(list: &str) -> Result<Vec<String>, TopologyError> {
    let mut out = Vec::new();
    for part in top_level_parts(list.trim()) {
        if part.is_empty() {
            return Err(bad(list, "empty node name"));
        }
        let Some(open) = part.find('[') else {
            out.push(part.to_string());
            continue;
        };
        let close = part.rfind(']').filter(|&c| c > open).ok_or_else(|| bad(list, "unclosed '['"))?;
        let (prefix, suffix) = (&part[..open], &part[close + 1..]);
        for range in part[open + 1..close].split(',') {
            let (lo, hi) = range.split_once('-').unwrap_or((range, range));
            let width = lo.len();
            let parse = |s: &str| s.parse::<u64>().map_err(|_| bad(list, &format!("'{range}' is not a number range")));
            let (a, b) = (parse(lo)?, parse(hi)?);
            if b < a {
                return Err(bad(list, &format!("range '{range}' runs backwards")));
            }
            for n in a..=b {
                out.push(format!("{prefix}{n:0width$}{suffix}"));
            }
        }
    }
    Ok(out)
}

/// `2(x3),1` → `[2, 2, 2, 1]`.
pub fn expand_tasks_per_node(spec: &str) -> Result<Vec<u32>, TopologyError> {
    let mut out = Vec::new();
    for part in spec.trim().split(',') {
        let (count, times) = match part.split_once("(x") {
            Some((c, rest)) => (c, rest.strip_suffix(')').ok_or_else(|| bad(spec, "expected 'N(xM)'"))?),
            None => (part, "1"),
        };
        let count: u32 = count.parse().map_err(|_| bad(spec, &format!("'{part}' is not a task count")))?;
        let times: usize = times.parse().map_err(|_| bad(spec, &format!("'{part}' has a bad repeat")))?;
        out.extend(std::iter::repeat_n(count, times));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_lists() {
        assert_eq!(expand_nodelist("h[1-3,5]").unwrap(), ["h1", "h2", "h3", "h5"]);
        assert_eq!(expand_nodelist("gpu01,n[08-10]x").unwrap(), ["gpu01", "n08x", "n09x", "n10x"]);
        assert_eq!(expand_nodelist("single").unwrap(), ["single"]);
        assert!(expand_nodelist("h[3-1]").unwrap_err().to_string().contains("backwards"));
        assert!(expand_nodelist("h[1-").is_err());
        assert!(expand_nodelist("a,,b").is_err());
    }

    #[test]
    fn tasks_per_node() {
        assert_eq!(expand_tasks_per_node("2(x3),1").unwrap(), [2, 2, 2, 1]);
        assert_eq!(expand_tasks_per_node("4").unwrap(), [4]);
        assert!(expand_tasks_per_node("x").is_err());
        assert!(expand_tasks_per_node("2(x3").is_err());
    }
}
