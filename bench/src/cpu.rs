//! CPU used by named processes and their direct children during the load phase, from
//! `/proc/<pid>/stat`, so a bench run can say where the machine's two cores went.

use std::collections::HashMap;
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

/// `(ppid, utime + stime in clock ticks)` of a process, from /proc (None once it is gone).
fn stat(pid: u32) -> Option<(u32, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces: fields start after the last ')'.
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After ')': state(0) ppid(1) ... utime is field 14 of the line, i.e. index 11 here.
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some((f.get(1)?.parse().ok()?, ticks))
}

/// CPU seconds process `pid` has used so far (0 once it is gone).
pub fn cpu_secs_of(pid: u32) -> f64 {
    stat(pid).map_or(0.0, |(_, ticks)| ticks as f64 / USER_HZ)
}

/// Clock ticks per second of /proc times (USER_HZ; 100 on Linux).
const USER_HZ: f64 = 100.0;

/// CPU ticks of each target's processes and their direct children, by pid. Children count
/// because a server forks workers during a run (PostgreSQL starts a backend per connection,
/// and pools connect lazily): give the parent's pid (PostgreSQL's postmaster) and every
/// backend is included, also those that start after the first snapshot.
pub type CpuSnapshot = Vec<HashMap<u32, u64>>;

pub fn cpu_snapshot(targets: &[CpuTarget]) -> CpuSnapshot {
    let all: Vec<(u32, u32, u64)> = std::fs::read_dir("/proc")
        .map(|dir| {
            dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
                .filter_map(|pid| stat(pid).map(|(ppid, ticks)| (pid, ppid, ticks)))
                .collect()
        })
        .unwrap_or_default();
    targets
        .iter()
        .map(|t| {
            all.iter()
                .filter(|(pid, ppid, _)| t.pids.contains(pid) || t.pids.contains(ppid))
                .map(|&(pid, _, ticks)| (pid, ticks))
                .collect()
        })
        .collect()
}

/// CPU each target used since `before`: a process that started since counts in full; one that
/// ended in between is lost (its last ticks are gone with it).
pub fn cpu_use(targets: &[CpuTarget], before: &CpuSnapshot, wall: Duration) -> Vec<CpuUse> {
    cpu_between(targets, before, &cpu_snapshot(targets), wall)
}

/// CPU each target used between two snapshots `wall` apart (as [`cpu_use`], to `after`).
pub fn cpu_between(
    targets: &[CpuTarget],
    before: &CpuSnapshot,
    after: &CpuSnapshot,
    wall: Duration,
) -> Vec<CpuUse> {
    targets
        .iter()
        .zip(before.iter().zip(after))
        .map(|(t, (b, a))| {
            let ticks: u64 = a
                .iter()
                .map(|(pid, now)| now.saturating_sub(b.get(pid).copied().unwrap_or(0)))
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
        let before = stat(me).unwrap().1;
        let mut x = 0u64;
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_millis(300) {
            x = x.wrapping_add(std::hint::black_box(1));
        }
        assert!(x > 0);
        assert!(
            stat(me).unwrap().1 > before,
            "a busy loop shows up in /proc"
        );
    }

    #[test]
    fn a_child_started_after_the_first_snapshot_is_counted_with_its_parent() {
        let me = std::process::id();
        let targets = [CpuTarget {
            name: "me".into(),
            pids: vec![me],
        }];
        let before = cpu_snapshot(&targets);
        // A child that burns CPU for about half a second, started after the snapshot.
        let mut child = std::process::Command::new("sh")
            .arg("-c")
            .arg("i=0; while [ $i -lt 400000 ]; do i=$((i+1)); done")
            .spawn()
            .unwrap();
        let child_pid = child.id();
        assert!(!before[0].contains_key(&child_pid));
        // Its ticks show up under the parent's target once it has run a little.
        let t0 = Instant::now();
        let seen = loop {
            let ticks = cpu_snapshot(&targets)[0].get(&child_pid).copied();
            if ticks.unwrap_or(0) > 0 || t0.elapsed() > Duration::from_secs(10) {
                break ticks;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let used = cpu_use(&targets, &before, Duration::from_secs(1));
        child.wait().unwrap();
        let seen = seen.expect("the child is counted with its parent");
        assert!(seen > 0);
        assert!(used[0].cpu_secs >= seen as f64 / USER_HZ, "{used:?}");
    }
}
