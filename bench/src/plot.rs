//! The crowd's figure, drawn from its own lines (`crate::burst`): answers/s and p99 against
//! the arrival rate, for both designs, side by side (SVG; BENCHMARKS.md shows it).

use std::path::Path;

use plotters::prelude::*;

use crate::burst::STEPS;
use crate::lines::Lines;

/// `(arrival rate, answers/s, p99 ms)` of each step a design ran, from lines named by `name`.
fn points(l: &Lines, name: impl Fn(&crate::burst::Step) -> &'static str) -> Vec<(f64, f64, f64)> {
    STEPS
        .iter()
        .filter_map(|s| {
            let line = l.get(name(s));
            Some((
                line.num("sent_per_s")?,
                line.num("answers_per_s")?,
                line.num("api_p99_ms")?,
            ))
        })
        .collect()
}

const SECKILL: RGBColor = RGBColor(0x1f, 0x77, 0xb4);
const DIRECT: RGBColor = RGBColor(0xd6, 0x27, 0x28);

/// Draws `path` from the crowd's lines; an error when no step ran.
pub fn crowd_svg(l: &Lines, path: &Path) -> anyhow::Result<()> {
    let seckill = points(l, |s| s.seckill);
    let direct = points(l, |s| s.direct);
    anyhow::ensure!(
        !seckill.is_empty() && !direct.is_empty(),
        "no crowd step to draw"
    );
    let all = seckill.iter().chain(&direct);
    let rate_max = all.clone().map(|p| p.0).fold(1.0, f64::max) * 1.3;
    let rate_min = all.clone().map(|p| p.0).fold(f64::MAX, f64::min) * 0.7;
    let answers_max = all.clone().map(|p| p.0.max(p.1)).fold(1.0, f64::max) * 1.1;
    let p99_max = all.clone().map(|p| p.2).fold(1.0, f64::max) * 2.0;
    let p99_min = all.map(|p| p.2).fold(f64::MAX, f64::min).max(0.1) * 0.5;

    let root = SVGBackend::new(path, (1100, 460)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(550);
    let mut chart = ChartBuilder::on(&left)
        .caption("Answers/s against arrivals/s", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d((rate_min..rate_max).log_scale(), 0.0..answers_max)?;
    chart
        .configure_mesh()
        .x_desc("arrivals/s (open loop)")
        .y_desc("answers/s")
        .draw()?;
    // Every request answered as it arrives: the diagonal.
    chart
        .draw_series(LineSeries::new(
            [(rate_min, rate_min), (rate_max, rate_max)],
            BLACK.mix(0.3),
        ))?
        .label("answered as they arrive")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLACK.mix(0.3)));
    for (name, pts, color) in [
        ("seckill", &seckill, SECKILL),
        ("direct PostgreSQL", &direct, DIRECT),
    ] {
        let xy: Vec<(f64, f64)> = pts.iter().map(|p| (p.0, p.1)).collect();
        chart
            .draw_series(LineSeries::new(xy.clone(), color.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color));
        chart.draw_series(xy.into_iter().map(|c| Circle::new(c, 4, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;

    let mut chart = ChartBuilder::on(&right)
        .caption("p99 from planned start (ms)", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(
            (rate_min..rate_max).log_scale(),
            (p99_min..p99_max).log_scale(),
        )?;
    chart
        .configure_mesh()
        .x_desc("arrivals/s (open loop)")
        .y_desc("p99 ms (timeouts at 10 s)")
        .draw()?;
    for (name, pts, color) in [
        ("seckill", &seckill, SECKILL),
        ("direct PostgreSQL", &direct, DIRECT),
    ] {
        let xy: Vec<(f64, f64)> = pts.iter().map(|p| (p.0, p.2)).collect();
        chart
            .draw_series(LineSeries::new(xy.clone(), color.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color));
        chart.draw_series(xy.into_iter().map(|c| Circle::new(c, 4, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
