--[[
burst_buffer.lua: dsstage datasets the burst-buffer way, for slurmctld's burst_buffer/lua
(BurstBufferType=burst_buffer/lua; this file, dsstage_submit.lua and the generated
dsstage_catalog.lua next to slurm.conf). A job asks for datasets with a directive in its
script or on the command line:

    #BB_LUA dataset=imagenet22t,coco          sbatch --bb "#BB_LUA dataset=coco"

which is the same request as --dataset (job_submit's check reads these directives too and
records them as it records --dataset). What each callback does, and where it runs:

  slurm_bb_job_process  (inside slurmctld, at submit: returns at once) validates the
      directives with the catalog and the messages of the job_submit check; Slurm 22.05
      does not pass the user here, so restricted datasets are checked by job_submit (which
      is told the user) and by the Prolog.
  slurm_bb_data_in      (slurmscriptd, while the job pends with an expected start) takes
      a demand snapshot now (`dsstage demand-poller --once`), so that `dsstage prefetch` on
      the nodes backfill planned for the job starts staging at its next round instead of
      after the poller's next one. It never fails the job: pre-staging is an optimisation.
  slurm_bb_paths        (inside slurmctld: returns at once) sets DSSTAGE_BB_DATASETS in
      the job's environment; the node-local paths (DSSTAGE_PATH_<NAME>) come from the
      TaskProlog, since they depend on the node.
  slurm_bb_get_status   (slurmscriptd) answers `scontrol show bbstat [JOBID | dataset NAME
      | node HOSTLIST]` with `dsstage status` for that job, dataset or nodes.
  slurm_bb_pre_run      (slurmscriptd, after allocation; the job's Prologs wait for it)
      records the datasets in <state_dir>/bb/<job id> (`dsstage bb record`): on 22.05 this
      is the only way a directive reaches the Prolog, which stages on the allocated nodes as
      for --dataset (the defaults file names the directory: DSSTAGE_BB_REQUESTS). If the
      record cannot be written, the job is held with the reason rather than run without
      its data.
  slurm_bb_job_teardown (slurmscriptd, at the end) forgets the record (`dsstage bb forget`);
      the Epilog releases the job's leases as for --dataset.
  the others            succeed at once.

Slurm 22.05 passes (job_id, job_script, ...) without uid, gid or the job's nodes; 23.02 adds
uid and gid (and a job_info table), which job_process then uses for the access check.
]]

local here = string.match(debug.getinfo(1, "S").source, "^@(.*/)") or "/etc/slurm/"
package.path = here .. "?.lua;" .. package.path
local dsstage = require("dsstage_submit")
dsstage.catalog_path = here .. "dsstage_catalog.lua"

-- the job script's text: Slurm passes the path of the script file
local function script_text(script)
	if type(script) ~= "string" then return nil end
	if string.find(script, "\n", 1, true) then return script end
	local f = io.open(script, "r")
	if not f then return nil end
	local text = f:read("*a")
	f:close()
	return text
end

-- the datasets a job's directives ask for ({} for none), or nil and a message
local function requested(script)
	local value, err = dsstage.bb_request(script_text(script))
	if err then return nil, err end
	if value == nil then return {} end
	return dsstage.parse(value)
end

local function quote(arg)
	return "'" .. string.gsub(arg, "'", "'\\''") .. "'"
end

-- dsstage's command line (from the catalog: the installation that wrote it) with args
local function command(args)
	local cat = dsstage.catalog()
	local argv = {}
	for _, a in ipairs((cat and cat.command) or { "/usr/bin/dsstage" }) do argv[#argv + 1] = quote(a) end
	for _, a in ipairs(args) do argv[#argv + 1] = quote(a) end
	return table.concat(argv, " ")
end

function slurm_bb_job_process(job_script, uid, gid)
	local names, err = requested(job_script)
	if names == nil then return slurm.ERROR, err end
	if #names == 0 then return slurm.SUCCESS end
	local cat, cerr = dsstage.catalog()
	if cat == nil then return slurm.ERROR, cerr end
	return dsstage.validate(cat, names, uid)
end

function slurm_bb_pools()
	return slurm.SUCCESS
end

function slurm_bb_setup(job_id, uid, gid, pool, bb_size, job_script)
	return slurm.SUCCESS
end

function slurm_bb_data_in(job_id, job_script, uid, gid)
	local names = requested(job_script)
	if names and #names > 0 then
		local rc = os.execute(command({ "demand-poller", "--once" }) .. " >/dev/null 2>&1")
		slurm.log_info("dsstage: job %s wants %s: demand snapshot taken for the nodes' prefetch (exit %s)",
			tostring(job_id), table.concat(names, ","), tostring(rc))
	end
	return slurm.SUCCESS
end

function slurm_bb_real_size(job_id, uid, gid)
	return slurm.SUCCESS
end

function slurm_bb_paths(job_id, job_script, path_file, uid, gid)
	local names = requested(job_script)
	if names and #names > 0 then
		local f = io.open(path_file, "w")
		if f then
			f:write("DSSTAGE_BB_DATASETS=" .. table.concat(names, ",") .. "\n")
			-- whose request it is: a job this one submits inherits the variables, not the request
			f:write("DSSTAGE_BB_JOB=" .. tostring(job_id) .. "\n")
			f:close()
		end
	end
	return slurm.SUCCESS
end

-- the Prolog waits for this: record the request where the job's Prologs read it
function slurm_bb_pre_run(job_id, job_script, uid, gid)
	local names = requested(job_script)
	if names == nil or #names == 0 then return slurm.SUCCESS end
	local value = table.concat(names, ",")
	local p = io.popen(command({ "bb", "record", tostring(job_id), value }) .. " 2>&1; echo \"dsstage-exit=$?\"")
	local out = p and p:read("*a") or ""
	if p then p:close() end
	if not string.find(out, "dsstage%-exit=0%s*$") then
		-- without the record the job would run without its datasets and without a word
		local why = string.gsub(string.gsub(out, "dsstage%-exit=%d+%s*$", ""), "%s+", " ")
		slurm.log_error("dsstage: job %s: recording #BB_LUA dataset=%s failed: %s", tostring(job_id), value, why)
		return slurm.ERROR, "dsstage could not record the #BB_LUA dataset=" .. value .. " request for the Prolog: " .. why
	end
	return slurm.SUCCESS
end

function slurm_bb_post_run(job_id, job_script, uid, gid)
	return slurm.SUCCESS
end

function slurm_bb_data_out(job_id, job_script, uid, gid)
	return slurm.SUCCESS
end

function slurm_bb_job_teardown(job_id, job_script, hurry, uid, gid)
	os.execute(command({ "bb", "forget", tostring(job_id) }) .. " >/dev/null 2>&1")
	return slurm.SUCCESS
end

-- scontrol show bbstat [JOBID | job JOBID | dataset NAME | node HOSTLIST]
function slurm_bb_get_status(uid, gid, ...)
	local args = { ... }
	local argv = { "status" }
	local what, value = args[1], args[2]
	if what ~= nil and string.match(what, "^%d+$") then
		what, value = "job", what
	end
	local flags = { job = "--job", dataset = "--dataset", node = "--node" }
	if what ~= nil then
		if flags[what] == nil or value == nil or not string.match(value, "^[%w%[%],._-]+$") or #args > 2 then
			return slurm.SUCCESS, "usage: scontrol show bbstat [JOBID | job JOBID | dataset NAME | node HOSTLIST]\n"
		end
		argv[#argv + 1] = flags[what]
		argv[#argv + 1] = value
	end
	local p = io.popen(command(argv) .. " 2>&1")
	if p == nil then return slurm.ERROR end
	local out = p:read("*a")
	p:close()
	return slurm.SUCCESS, out
end
