//! Reading a role's `/metrics`.

/// The sum of every sample of a counter on a role's `/metrics` whose labels contain `labels`
/// (0 when it has none yet).
pub async fn metric(port: u16, name: &str, labels: &str) -> f64 {
    let Ok(r) = reqwest::get(format!("http://127.0.0.1:{port}/metrics")).await else {
        return 0.0;
    };
    let text = r.text().await.unwrap_or_default();
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .filter(|(series, _)| {
            *series == name || (series.starts_with(&format!("{name}{{")) && series.contains(labels))
        })
        .filter_map(|(_, v)| v.parse::<f64>().ok())
        .sum()
}

/// The value of one sample (`name{labels}` exactly as exported) on a role's `/metrics`, if it
/// is there.
pub async fn gauge(port: u16, series: &str) -> Option<f64> {
    let r = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .ok()?;
    let text = r.text().await.ok()?;
    text.lines()
        .filter_map(|l| l.rsplit_once(' '))
        .find(|(s, _)| *s == series)
        .and_then(|(_, v)| v.parse().ok())
}

/// Asserts a role's `/metrics` exposes every name within 20 s (a gauge sampled from the
/// broker appears at the role's first sample that reads it).
pub async fn assert_metrics(url: &str, names: &[&str]) {
    let started = std::time::Instant::now();
    loop {
        let text = reqwest::get(url).await.unwrap().text().await.unwrap();
        let missing: Vec<&&str> = names.iter().filter(|n| !text.contains(**n)).collect();
        if missing.is_empty() {
            return;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(20),
            "{url} lacks {missing:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
}
