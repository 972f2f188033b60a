//! `kolo top`: a job's ranks in the terminal, refreshed every second
//! (ratatui): state, CPU, memory, steps and collectives per second, the
//! share of time waiting in collectives, the age of the last output line;
//! stragglers marked. `q` (or Esc, Ctrl-C) quits.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::Constraint;
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Row, Table};
use ratatui::Frame;
use serde_json::Value;

use crate::inspect::status_value;

const REFRESH: Duration = Duration::from_secs(1);

pub(crate) fn top(job: Option<&str>) -> Result<i32> {
    if !std::io::stdout().is_terminal() {
        bail!("kolo top draws on a terminal; for a pipe or a file use kolo status --json");
    }
    // no job, or several: say so before taking the screen
    let first = status_value(job)?;
    let id = first["job"].as_str().unwrap_or_default().to_string();
    let mut terminal = ratatui::init();
    let result = watch(&mut terminal, &id, first);
    ratatui::restore();
    result
}

fn watch(terminal: &mut ratatui::DefaultTerminal, id: &str, first: Value) -> Result<i32> {
    let (mut now, mut at, mut before) = (first, Instant::now(), None::<(Value, Instant)>);
    let mut ended = false;
    loop {
        let rates = before.as_ref().map(|(old, then)| (old, at.duration_since(*then).as_secs_f64()));
        terminal.draw(|frame| draw(frame, &now, rates, ended))?;
        let next = at + REFRESH;
        loop {
            let left = next.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            if event::poll(left)? {
                if let Event::Key(key) = event::read()? {
                    let ctrl_c = key.code == KeyCode::Char('c') && key.modifiers.contains(KeyModifiers::CONTROL);
                    if key.kind == KeyEventKind::Press
                        && (key.code == KeyCode::Char('q') || key.code == KeyCode::Esc || ctrl_c)
                    {
                        return Ok(0);
                    }
                }
                terminal.draw(|frame| draw(frame, &now, rates, ended))?;
            }
        }
        if ended {
            continue;
        }
        match status_value(Some(id)) {
            Ok(fresh) => {
                before = Some((std::mem::replace(&mut now, fresh), at));
                at = Instant::now();
            }
            Err(_) => ended = true,
        }
    }
}

/// Per second, from the previous look, for rank `i`'s `key`.
fn rate(now: &Value, rates: Option<(&Value, f64)>, i: usize, key: &str) -> String {
    let (Some((old, secs)), Some(n)) = (rates, now["ranks"][i][key].as_u64()) else { return "-".into() };
    let Some(o) = old["ranks"][i][key].as_u64() else { return "-".into() };
    if secs <= 0.0 {
        return "-".into();
    }
    format!("{:.1}", n.saturating_sub(o) as f64 / secs)
}

fn draw(frame: &mut Frame, now: &Value, rates: Option<(&Value, f64)>, ended: bool) {
    let stragglers: Vec<u64> = now["stragglers"].as_array().into_iter().flatten().filter_map(Value::as_u64).collect();
    let ranks = now["ranks"].as_array().cloned().unwrap_or_default();
    // GPU columns where NVML answered for some rank
    let gpus = ranks.iter().any(|r| r["gpu_memory_bytes"].is_u64());
    let rows: Vec<Row> = ranks
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let rank = r["rank"].as_u64().unwrap_or(i as u64);
            let pid = r["pid"].as_u64().map_or("-".into(), |p| p.to_string());
            let cpu = r["cpu_percent"].as_f64().map_or("-".into(), |c| format!("{c:.0}"));
            let rss = r["rss_bytes"].as_u64().map_or("-".into(), |b| format!("{:.0}M", b as f64 / 1048576.0));
            let wait = r["wait_fraction"].as_f64().map_or("-".into(), |w| format!("{:.0}%", w * 100.0));
            let output = r["last_output_s"].as_f64().map_or("-".into(), |s| format!("{s:.0}s"));
            let mark = if stragglers.contains(&rank) { "straggler" } else { "" };
            let mut cells = vec![
                rank.to_string(),
                r["host"].as_str().unwrap_or("?").to_string(),
                pid,
                r["state"].as_str().unwrap_or("?").to_string(),
                cpu,
                rss,
            ];
            if gpus {
                cells.push(crate::inspect::gpu_percent_text(r));
                cells.push(crate::inspect::gpu_memory_text(r));
            }
            cells.extend([
                rate(now, rates, i, "steps"),
                rate(now, rates, i, "collectives"),
                wait,
                output,
                mark.to_string(),
            ]);
            let row = Row::new(cells);
            if mark.is_empty() {
                row
            } else {
                row.style(Style::default().add_modifier(Modifier::BOLD))
            }
        })
        .collect();
    let mut names = vec!["RANK", "HOST", "PID", "STATE", "CPU%", "RSS"];
    let mut widths = vec![
        Constraint::Length(5),
        Constraint::Min(6),
        Constraint::Length(8),
        Constraint::Length(9),
        Constraint::Length(5),
        Constraint::Length(6),
    ];
    if gpus {
        names.extend(["GPU%", "GPU MEM"]);
        widths.extend([Constraint::Length(5), Constraint::Length(9)]);
    }
    names.extend(["STEP/s", "COLL/s", "WAIT", "OUTPUT", ""]);
    let header = Row::new(names).style(Style::default().add_modifier(Modifier::REVERSED));
    widths.extend([
        Constraint::Length(7),
        Constraint::Length(7),
        Constraint::Length(5),
        Constraint::Length(7),
        Constraint::Length(9),
    ]);
    let state = if ended { " (ended)" } else { "" };
    let title = format!(
        " kolo top: job {}{state}, {} ranks: {} ",
        now["job"].as_str().unwrap_or("?"),
        ranks.len(),
        now["command"].as_str().unwrap_or("")
    );
    let table = Table::new(rows, widths)
        .header(header)
        .block(Block::bordered().title(Line::from(title)).title_bottom(Line::from(" q quits ")));
    frame.render_widget(table, frame.area());
}
