//! `seckill plan` (docs/SCALING.md#sizing-a-fleet): the worked plan the docs show is what the
//! command prints from the shipped costs, and a costs file that is missing or is not one is
//! refused, naming it.

fn plan(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_seckill"))
        .arg("plan")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("SECKILL_ENV", "test")
        .output()
        .expect("binary runs")
}

const WORKED: [&str; 6] = ["--peak-rps", "200000", "--units", "50000", "--skus", "20"];

#[test]
fn the_worked_plan_in_the_docs_is_what_the_shipped_costs_give() {
    let out = plan(&WORKED);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/SCALING.md"),
    )
    .unwrap();
    assert!(
        doc.contains(text.trim_end()),
        "docs/SCALING.md does not show what `seckill plan {}` prints now:\n{text}",
        WORKED.join(" ")
    );

    let mut json_args = WORKED.to_vec();
    json_args.push("--json");
    let out = plan(&json_args);
    let p: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // Every role at least twice (one instance is no fleet), and the budget of that fleet.
    for role in ["api_instances", "brokers", "consume_instances"] {
        assert!(p[role].as_u64().unwrap() >= 2, "{role}: {}", p[role]);
    }
    let api = p["connections"]["roles"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["role"] == "api")
        .unwrap();
    assert_eq!(api["instances"], p["api_instances"]);
    assert!(p["drain_secs"].as_f64().unwrap() >= 0.0);
}

#[test]
fn a_missing_or_foreign_costs_file_is_refused_by_name() {
    let out = plan(&[&WORKED[..], &["--costs", "/nonexistent/costs.json"]].concat());
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/costs.json"));
    let out = plan(&[&WORKED[..], &["--costs", "config/default.toml"]].concat());
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a costs file"));
    let out = plan(&["--peak-rps", "0", "--units", "1", "--skus", "1"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--peak-rps"));
}
