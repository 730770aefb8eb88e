// Command holder is the chaos suite's share holder process: it spends one refilling bucket
// through a client.Limiter (local decisions on its share) and reports every local admission
// on stdout before it counts as used, so that a kill loses no admission that was used.
//
// Each line is "call_unix_ns return_unix_ns count": count admissions decided between the two
// wall-clock times. The client configuration comes from the QUOTAD_* environment.
//
// The Limiter's clocks are a hook (client.Config.LimiterClock) driven by the file -control:
// it holds "raw_rate boot_rate", the speeds of the holder's CLOCK_MONOTONIC_RAW and
// CLOCK_BOOTTIME relative to real time ("1 1" normal, "0 1" stopped as in a VM suspend —
// BOOTTIME counts the suspend, RAW does not — "3 1" or "0.3 1" a raw clock slewed far past
// NTP's bound). The Limiter refills on the slower and expires on the faster, so none of these
// may make it admit more than its share. A third field "cut" partitions the holder from the
// cluster: every RPC it makes fails Unavailable (a client interceptor) until the field goes.
//
// Under the build tag chaos_bug_holderexpiry the holder is broken on purpose: once its share
// has ended it keeps admitting at the last share's rate from a bucket of its own (a holder
// that ignores its expiry); the bounded-admission checker must catch it.
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/quotad/quotad/client"
)

func main() {
	domain := flag.String("domain", "", "limits domain")
	key := flag.String("key", "", "descriptor key of the bucket")
	value := flag.String("value", "", "descriptor value of the bucket")
	rate := flag.Float64("rate", 50, "attempts per second")
	control := flag.String("control", "", "clock control file (raw_rate boot_rate)")
	flag.Parse()

	clk := newControlledClock()
	if *control != "" {
		go clk.follow(*control)
	}
	cfg := client.DefaultConfig()
	cfg.LoadEnv()
	cfg.LimiterClock = clk
	cfg.DialOptions = append(cfg.DialOptions, grpc.WithChainUnaryInterceptor(clk.partition))
	cl, err := client.New(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "holder:", err)
		os.Exit(2)
	}
	lim := cl.Limiter(client.Request{Domain: *domain, Descriptors: client.Descriptors(*key, *value)}, client.LimiterOptions{Demand: *rate})
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()

	w := bufio.NewWriterSize(os.Stdout, 4096)
	const tick = 10 * time.Millisecond
	per := *rate * tick.Seconds()
	var owed float64
	allow := allowFunc(lim)
	for next := time.Now(); ctx.Err() == nil; {
		call := time.Now()
		owed += per
		var n uint64
		for ; owed >= 1; owed-- {
			if allow() {
				n++
			}
		}
		if n > 0 {
			fmt.Fprintf(w, "%d %d %d\n", call.UnixNano(), time.Now().UnixNano(), n)
			w.Flush()
		}
		next = next.Add(tick)
		if d := time.Until(next); d > 0 {
			time.Sleep(d)
		} else {
			next = time.Now()
		}
	}
	lim.Close()
	cl.Close()
}

// controlledClock is a client.LimiterClock whose two clocks run at rates read from a file.
type controlledClock struct {
	mu    sync.Mutex
	start time.Time
	at    time.Duration // real time of the last rate change, since start
	raw   [2]float64    // raw, boot values at the last change (ns)
	rates [2]float64
	cut   atomic.Bool // partitioned from the cluster
}

// partition fails every RPC while the holder is cut off, as a network partition would
// (after a short wait, like a connection attempt that gets nowhere).
func (c *controlledClock) partition(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if c.cut.Load() {
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
		return status.Error(codes.Unavailable, "chaos: holder partitioned from the cluster")
	}
	return invoker(ctx, method, req, reply, cc, opts...)
}

func newControlledClock() *controlledClock {
	return &controlledClock{start: time.Now(), rates: [2]float64{1, 1}}
}

func (c *controlledClock) Now() (raw, boot int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	d := float64(time.Since(c.start) - c.at)
	return int64(c.raw[0] + d*c.rates[0]), int64(c.raw[1] + d*c.rates[1])
}

func (c *controlledClock) set(raw, boot float64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.rates == [2]float64{raw, boot} {
		return
	}
	now := time.Since(c.start)
	d := float64(now - c.at)
	c.raw[0] += d * c.rates[0]
	c.raw[1] += d * c.rates[1]
	c.at, c.rates = now, [2]float64{raw, boot}
}

// follow polls the control file every 5 ms (a missing or malformed file means "1 1").
func (c *controlledClock) follow(path string) {
	for {
		raw, boot, cut := 1.0, 1.0, false
		if b, err := os.ReadFile(path); err == nil {
			f := strings.Fields(string(b))
			if len(f) == 3 && f[2] == "cut" {
				cut, f = true, f[:2]
			}
			if len(f) == 2 {
				r, err1 := strconv.ParseFloat(f[0], 64)
				bt, err2 := strconv.ParseFloat(f[1], 64)
				if err1 == nil && err2 == nil && r >= 0 && bt >= 0 {
					raw, boot = r, bt
				}
			}
		}
		c.set(raw, boot)
		c.cut.Store(cut)
		time.Sleep(5 * time.Millisecond)
	}
}
