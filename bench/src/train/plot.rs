//! Quality over time and over epochs, one line per run, as an SVG file.

use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::prelude::*;

use super::{EpochReport, Mode};

fn colour(mode: Mode) -> RGBColor {
    match mode {
        Mode::Single => RGBColor(90, 90, 90),
        Mode::Classic => RGBColor(200, 60, 40),
        Mode::Localize => RGBColor(30, 110, 200),
        Mode::Hybrid => RGBColor(40, 160, 80),
        Mode::Intent => RGBColor(150, 60, 170),
    }
}

/// Draws the runs' quality (RMSE or MRR) against training time and against epochs.
pub fn draw(path: &Path, task: &str, reports: &[EpochReport]) -> Result<()> {
    let points: Vec<(&EpochReport, &str, f64)> = reports.iter().filter_map(|r| r.headline().map(|(name, v)| (r, name, v))).collect();
    if points.is_empty() {
        return Err(anyhow!("no evaluated epochs to plot"));
    }
    let measure = points[0].1;
    let (mut lo, mut hi) = points.iter().fold((f64::MAX, f64::MIN), |(l, h), p| (l.min(p.2), h.max(p.2)));
    if (hi - lo).abs() < 1e-9 {
        lo -= 0.05;
        hi += 0.05;
    }
    let pad = (hi - lo) * 0.08;
    let max_time = points.iter().map(|p| p.0.elapsed_s).fold(0.0, f64::max).max(1e-3);
    let min_time = points.iter().map(|p| p.0.elapsed_s).fold(f64::MAX, f64::min).max(1e-4);
    // Runs that differ by orders of magnitude are drawn against log10(time).
    let log_time = max_time / min_time > 100.0;
    let time_x = |t: f64| if log_time { t.max(1e-4).log10() } else { t };
    let max_epoch = points.iter().map(|p| p.0.epoch).max().unwrap_or(1).max(1);
    let root = SVGBackend::new(path, (1100, 450)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let (left, right) = root.split_horizontally(550);
    let modes = [Mode::Single, Mode::Classic, Mode::Localize, Mode::Hybrid, Mode::Intent];
    for (area, by_time) in [(left, true), (right, false)] {
        let (x_min, x_max) = match (by_time, log_time) {
            (true, true) => (time_x(min_time) - 0.2, time_x(max_time) + 0.2),
            (true, false) => (0.0, max_time * 1.05),
            _ => (0.0, max_epoch as f64 + 0.5),
        };
        let mut chart = ChartBuilder::on(&area)
            .caption(format!("{task}: {measure} over {}", if by_time { "training time" } else { "epochs" }), ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(x_min..x_max, (lo - pad)..(hi + pad))
            .map_err(|e| anyhow!("{e}"))?;
        let x_desc = match (by_time, log_time) {
            (true, true) => "training time [s], log scale",
            (true, false) => "training time [s]",
            _ => "epoch",
        };
        let label = move |x: &f64| if by_time && log_time { format!("{:.3}", 10f64.powf(*x)) } else { format!("{x:.1}") };
        chart.configure_mesh().x_desc(x_desc).y_desc(measure).x_label_formatter(&label).draw().map_err(|e| anyhow!("{e}"))?;
        for mode in modes {
            let series: Vec<(f64, f64)> =
                points.iter().filter(|p| p.0.mode == mode).map(|p| (if by_time { time_x(p.0.elapsed_s) } else { p.0.epoch as f64 }, p.2)).collect();
            if series.is_empty() {
                continue;
            }
            let c = colour(mode);
            chart
                .draw_series(LineSeries::new(series.clone(), c.stroke_width(2)))
                .map_err(|e| anyhow!("{e}"))?
                .label(mode.name())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
            chart.draw_series(series.iter().map(|&(x, y)| Circle::new((x, y), 3, c.filled()))).map_err(|e| anyhow!("{e}"))?;
        }
        chart.configure_series_labels().border_style(BLACK).background_style(WHITE.mix(0.8)).draw().map_err(|e| anyhow!("{e}"))?;
    }
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}
