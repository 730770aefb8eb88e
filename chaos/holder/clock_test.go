package main

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

// The control file drives the two clocks: "1.5 1" runs RAW at 1.5x and BOOTTIME at 1x.
func TestControlledClock(t *testing.T) {
	p := filepath.Join(t.TempDir(), "clock")
	c := newControlledClock()
	go c.follow(p)
	if err := os.WriteFile(p, []byte("1.5 1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	r0, b0 := c.Now()
	time.Sleep(time.Second)
	r1, b1 := c.Now()
	dr, db := time.Duration(r1-r0), time.Duration(b1-b0)
	if dr < 1450*time.Millisecond || dr > 1600*time.Millisecond || db < 950*time.Millisecond || db > 1100*time.Millisecond {
		t.Fatalf("raw advanced %v, boot %v in 1s; want 1.5s and 1s", dr, db)
	}
}
