package main

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"time"
)

// DiskProbe is what a 4 KB write + fsync every 20 ms, in the directory the nodes write their
// logs to, measured while the sweep ran. The nodes' commits wait on the same disk, so a
// sweep's p999 is only as good as this: read the two together.
type DiskProbe struct {
	Samples int     `json:"samples"`
	P50Ms   float64 `json:"p50_ms"`
	P99Ms   float64 `json:"p99_ms"`
	MaxMs   float64 `json:"max_ms"`
	Over50  int     `json:"over_50ms"`
}

// probeDisk fsyncs a small file in dir until stop is closed and reports the latencies.
func probeDisk(dir string, stop <-chan struct{}) (DiskProbe, error) {
	path := filepath.Join(dir, "disk-probe")
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
	if err != nil {
		return DiskProbe{}, err
	}
	defer os.Remove(path)
	defer f.Close()
	buf := make([]byte, 4096)
	var lat []float64
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return summarizeDisk(lat), nil
		case <-tick.C:
		}
		start := time.Now()
		if _, err := f.WriteAt(buf, 0); err != nil {
			return DiskProbe{}, err
		}
		if err := f.Sync(); err != nil {
			return DiskProbe{}, err
		}
		lat = append(lat, float64(time.Since(start))/1e6)
	}
}

func summarizeDisk(lat []float64) DiskProbe {
	if len(lat) == 0 {
		return DiskProbe{}
	}
	slices.Sort(lat)
	p := DiskProbe{Samples: len(lat), P50Ms: lat[len(lat)/2], P99Ms: lat[len(lat)*99/100], MaxMs: lat[len(lat)-1]}
	for _, x := range lat {
		if x > 50 {
			p.Over50++
		}
	}
	return p
}

func (p DiskProbe) String() string {
	return fmt.Sprintf("fsync of 4 KB beside the sweep: %d samples, p50 %.2f ms, p99 %.2f ms, max %.1f ms, %d over 50 ms",
		p.Samples, p.P50Ms, p.P99Ms, p.MaxMs, p.Over50)
}
