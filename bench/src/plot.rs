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

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

/// A design's points on one panel: its name, `(arrivals/s, figure)` per step, its colour.
type Series<'a> = (&'a str, Vec<(f64, f64)>, RGBColor);

/// One panel: a figure of each design's steps against the arrival rate, both axes logarithmic;
/// `diagonal` draws "answered as they arrive".
fn panel(
    area: &Area,
    (caption, y_desc): (&str, &str),
    (x, y): ((f64, f64), (f64, f64)),
    designs: &[Series],
    diagonal: bool,
) -> anyhow::Result<()> {
    // The x axis is labelled at the steps' own arrival rates: a log scale's powers of ten
    // would leave the lower steps unlabelled.
    let mut steps: Vec<f64> = designs
        .iter()
        .flat_map(|d| d.1.iter().map(|p| p.0))
        .collect();
    steps.sort_by(f64::total_cmp);
    // Both designs' rates of a step differ by a request or two: one label per step.
    steps.dedup_by(|a, b| (*a - *b).abs() < 0.02 * b.abs());
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(
            (x.0..x.1).log_scale().with_key_points(steps),
            (y.0..y.1).log_scale(),
        )?;
    chart
        .configure_mesh()
        .x_desc("arrivals/s (open loop)")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_desc(y_desc)
        .draw()?;
    if diagonal {
        let grey = BLACK.mix(0.3);
        chart
            .draw_series(LineSeries::new([(x.0, x.0), (x.1, x.1)], grey))?
            .label("answered as they arrive")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], grey));
    }
    for (name, xy, color) in designs {
        let color = *color;
        chart
            .draw_series(LineSeries::new(xy.clone(), color.stroke_width(2)))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color));
        chart.draw_series(xy.iter().map(|c| Circle::new(*c, 4, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

/// Draws `path` from the crowd's lines: answers/s (left) and p99 (right) against arrivals/s;
/// an error when no step ran.
pub fn crowd_svg(l: &Lines, path: &Path) -> anyhow::Result<()> {
    let seckill = points(l, |s| s.seckill);
    let direct = points(l, |s| s.direct);
    anyhow::ensure!(
        !seckill.is_empty() && !direct.is_empty(),
        "no crowd step to draw"
    );
    let all: Vec<&(f64, f64, f64)> = seckill.iter().chain(&direct).collect();
    let range = |f: fn(&(f64, f64, f64)) -> f64| -> (f64, f64) {
        let v: Vec<f64> = all.iter().map(|p| f(p)).collect();
        let min = v.iter().copied().fold(f64::MAX, f64::min).max(0.1);
        let max = v.iter().copied().fold(0.0, f64::max).max(min * 2.0);
        (min * 0.7, max * 1.4)
    };
    let x = range(|p| p.0);
    let answers = {
        let (a, b) = range(|p| p.1);
        (a.min(x.0), b.max(x.1))
    };
    let series = |pick: fn(&(f64, f64, f64)) -> f64| -> Vec<Series> {
        vec![
            (
                "seckill",
                seckill.iter().map(|p| (p.0, pick(p))).collect(),
                SECKILL,
            ),
            (
                "direct PostgreSQL",
                direct.iter().map(|p| (p.0, pick(p))).collect(),
                DIRECT,
            ),
        ]
    };
    let root = SVGBackend::new(path, (1100, 460)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(550);
    let captions = ("Answers/s against arrivals/s", "answers/s");
    panel(&left, captions, (x, answers), &series(|p| p.1), true)?;
    let captions = ("p99 from planned start (ms)", "p99 ms (timeouts at 10 s)");
    panel(
        &right,
        captions,
        (x, range(|p| p.2)),
        &series(|p| p.2),
        false,
    )?;
    root.present()?;
    Ok(())
}
