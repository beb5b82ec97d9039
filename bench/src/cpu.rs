//! CPU used by named processes during the load phase, from `/proc/<pid>/stat`, so a bench
//! run can say where the machine's two cores went.

use std::time::Duration;

use serde::Serialize;

/// A process (or group of processes) whose CPU the bench reports.
#[derive(Debug, Clone)]
pub struct CpuTarget {
    pub name: String,
    pub pids: Vec<u32>,
}

pub fn parse_cpu_target(s: &str) -> Result<CpuTarget, String> {
    let (name, pids) = s
        .split_once('=')
        .ok_or_else(|| format!("--cpu {s}: expected name=pid[+pid...]"))?;
    let pids = pids
        .split(['+', ','])
        .filter(|p| !p.is_empty())
        .map(|p| {
            p.parse::<u32>()
                .map_err(|_| format!("--cpu {s}: bad pid {p}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if name.is_empty() || pids.is_empty() {
        return Err(format!("--cpu {s}: expected name=pid[+pid...]"));
    }
    Ok(CpuTarget {
        name: name.to_owned(),
        pids,
    })
}

#[derive(Debug, Clone, Serialize)]
pub struct CpuUse {
    pub name: String,
    pub cpu_secs: f64,
    /// Percent of one core over the load phase.
    pub core_pct: f64,
}

/// utime + stime of a process in clock ticks, from /proc (None once it is gone).
fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces: fields start after the last ')'.
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After ')': state(0) ppid(1) ... utime is field 14 of the line, i.e. index 11 here.
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// Clock ticks per second of /proc times (USER_HZ; 100 on Linux).
const USER_HZ: f64 = 100.0;

pub fn cpu_snapshot(targets: &[CpuTarget]) -> Vec<Vec<Option<u64>>> {
    targets
        .iter()
        .map(|t| t.pids.iter().map(|p| cpu_ticks(*p)).collect())
        .collect()
}

pub fn cpu_use(targets: &[CpuTarget], before: &[Vec<Option<u64>>], wall: Duration) -> Vec<CpuUse> {
    targets
        .iter()
        .zip(before)
        .map(|(t, b)| {
            let ticks: u64 = t
                .pids
                .iter()
                .zip(b)
                .filter_map(|(p, before)| Some(cpu_ticks(*p)?.saturating_sub((*before)?)))
                .sum();
            let secs = ticks as f64 / USER_HZ;
            CpuUse {
                name: t.name.clone(),
                cpu_secs: secs,
                core_pct: secs * 100.0 / wall.as_secs_f64().max(1e-9),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn cpu_targets_parse_and_read_this_process() {
        let t = parse_cpu_target("postgres=1+2,3").unwrap();
        assert_eq!(
            (t.name.as_str(), t.pids.clone()),
            ("postgres", vec![1, 2, 3])
        );
        assert!(parse_cpu_target("api").is_err());
        assert!(parse_cpu_target("api=x").is_err());
        let me = std::process::id();
        let before = cpu_ticks(me).unwrap();
        let mut x = 0u64;
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_millis(300) {
            x = x.wrapping_add(std::hint::black_box(1));
        }
        assert!(x > 0);
        assert!(
            cpu_ticks(me).unwrap() > before,
            "a busy loop shows up in /proc"
        );
    }
}
