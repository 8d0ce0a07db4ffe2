/**
 * progress.ts — byte progress for synth, pack and download: bytes done, rate and ETA.
 *
 * Owns: the one progress display of the packer (cli-progress on a terminal; on a pipe or log a
 * plain line every few seconds, so CI logs and `2>file` stay readable). Does not own: what is
 * counted (the callers).
 */
import { SingleBar } from "cli-progress";

export interface Progress {
  /** Begins a bar of `total` bytes; `done` already counted (a resumed run). */
  start(label: string, total: number, done?: number): void;
  add(bytes: number): void;
  /** Ends the bar: finished, or paused (another bar takes the line; start() resumes with the
   * count so far). Only a finished bar reports its total time. */
  stop(): void;
}

/** Discards everything (tests, --quiet, library use). */
export const silentProgress: Progress = { start() {}, add() {}, stop() {} };

function formatBytes(n: number): string {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i++;
  }
  return `${n.toFixed(i === 0 ? 0 : 1)} ${units[i]}`;
}

function formatSeconds(s: number): string {
  if (!Number.isFinite(s)) return "?";
  const m = Math.floor(s / 60);
  return m > 0 ? `${m}m${String(Math.round(s % 60)).padStart(2, "0")}s` : `${Math.round(s)}s`;
}

/** A bar on stderr: interactive when stderr is a terminal, else a line every `intervalMs`. */
export function stderrProgress(intervalMs = 5000): Progress {
  const stream = process.stderr;
  if (stream.isTTY) {
    let bar: SingleBar | undefined;
    let startedAt = 0;
    let startDone = 0;
    return {
      start(label, total, done = 0) {
        startedAt = Date.now();
        startDone = done;
        bar = new SingleBar({
          stream,
          format: `${label} [{bar}] {percentage}% | {doneBytes} / {totalBytes} | {rate} | ETA {etaText}`,
          hideCursor: true,
          etaBuffer: 50,
          fps: 5,
        });
        bar.start(total, done, { doneBytes: formatBytes(done), totalBytes: formatBytes(total), rate: "-", etaText: "?" });
      },
      add(bytes) {
        if (!bar) return;
        const value = bar.getProgress() * bar.getTotal() + bytes;
        const seconds = (Date.now() - startedAt) / 1000;
        const rate = seconds > 0 ? (value - startDone) / seconds : 0;
        bar.update(value, {
          doneBytes: formatBytes(value),
          totalBytes: formatBytes(bar.getTotal()),
          rate: rate > 0 ? `${formatBytes(rate)}/s` : "-",
          etaText: rate > 0 ? formatSeconds((bar.getTotal() - value) / rate) : "?",
        });
      },
      stop() {
        bar?.stop();
        bar = undefined;
      },
    };
  }
  let label = "";
  let total = 0;
  let done = 0;
  let startDone = 0;
  let startedAt = 0;
  let lastPrint = 0;
  const line = (final: boolean): void => {
    const seconds = (Date.now() - startedAt) / 1000;
    const rate = seconds > 0 ? (done - startDone) / seconds : 0;
    const pct = total > 0 ? ((100 * done) / total).toFixed(1) : "100.0";
    const eta = final ? `done in ${formatSeconds(seconds)}` : `ETA ${rate > 0 ? formatSeconds((total - done) / rate) : "?"}`;
    stream.write(`${label}: ${pct}% ${formatBytes(done)} / ${formatBytes(total)}, ${rate > 0 ? `${formatBytes(rate)}/s` : "-"}, ${eta}\n`);
  };
  return {
    start(l, t, d = 0) {
      label = l;
      total = t;
      done = d;
      startDone = d;
      startedAt = Date.now();
      lastPrint = startedAt;
    },
    add(bytes) {
      done += bytes;
      if (Date.now() - lastPrint >= intervalMs) {
        lastPrint = Date.now();
        line(false);
      }
    },
    stop() {
      if (label && done >= total) line(true);
      label = "";
    },
  };
}
